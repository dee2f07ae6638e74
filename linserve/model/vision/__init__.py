"""Images in: what the HTTP process does to a picture before the engine sees it
(:mod:`.images`: decoding and checks; :mod:`.qwen_prep`: the Qwen image processor's resize
and token count, torch-free), and the towers that turn one into embeddings
(:mod:`.qwen_tower`, torch, loaded by the engine only)."""
