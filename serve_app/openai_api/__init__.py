"""OpenAI Chat Completions and Responses APIs over Harmony; torch-free (see app.create_app)."""
