"""Text handling done in the frontend: tokenization, chat templates, detokenization, stops."""
