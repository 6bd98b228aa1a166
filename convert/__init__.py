"""Model conversion, `python -m specee.convert <command>`: Hugging Face Llama -> GGUF (hf), EAGLE head and
exit predictors merged into a GGUF (merge), SpecEE's eauto GGUF rewritten (import-specee), GGUF
inspection (inspect) and retyping (quantize; retype.py: dequantized copies for tests)."""
