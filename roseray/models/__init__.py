"""Model implementations (gpt2, llama family), their registry, presets and loading."""
