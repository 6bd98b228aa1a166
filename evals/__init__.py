"""specee.eval: dataset evaluations of speed and quality (python -m specee.eval)."""
