"""Frontend: tokenizer and chat template from the artifact resources."""
