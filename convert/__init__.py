"""Model conversion: Hugging Face Llama -> GGUF (hf), GGUF retyping and edited copies (retype)."""
