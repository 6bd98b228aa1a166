"""Training for SpecEE: features from the target model, the EAGLE draft head (python -m specee.autoee)."""
