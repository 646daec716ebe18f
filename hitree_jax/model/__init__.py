"""The model: `config` (ModelConfig), `llama` (the Flax Llama and its forward), `vocab` (a
draft's reduced vocabulary)."""
