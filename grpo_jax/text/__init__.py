"""Text: token ids to and from strings.

``tokenizer`` (the small `Tokenizer` interface and the tiny model's sentencepiece),
``bpe_tokenizer`` (byte-level BPE of imported models) and ``chat_templates`` (a model's own
chat template, rendered in a sandbox). Imports only the root modules.
"""
