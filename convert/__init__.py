"""Model conversion, `python -m specee.convert <command>`: Hugging Face Llama -> GGUF (hf), a draft head and
exit predictors merged into a GGUF or written as a draft head file (merge), SpecEE's eauto GGUF rewritten
(import-specee), GGUF inspection (inspect), retyping (quantize; retype.py: dequantized copies for tests) and
synthetic files for cost benchmarks (synth)."""
