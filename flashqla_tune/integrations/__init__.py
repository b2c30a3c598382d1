"""Routes from other stacks into flashqla-tune's op and packs: transformers models, vLLM and SGLang.
Each module imports its host stack lazily, so importing this package needs none of them."""
