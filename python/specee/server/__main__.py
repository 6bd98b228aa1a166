"""python -m specee.server: specee-server (see specee.server)."""

from specee.server import main

if __name__ == "__main__":
    main()
