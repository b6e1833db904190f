"""Front ends: the offline ``LLM`` API, the ``engine`` command and its flags, and what every front
end shares before a request reaches the engine client (chat templates, the tokenizer)."""
