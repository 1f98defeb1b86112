"""Our TOML sections (sections.py: each key declared with its default and meaning), the checks of their
structure (structure.py) and of torchtitan's own keys (torchtitan_keys.py), each refusal one line."""
