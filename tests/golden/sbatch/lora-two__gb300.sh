ConfigError: train.lora.adapters keeps one AdamW per adapter: set train.optimizer_offload=none
