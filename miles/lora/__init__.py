"""LoRA as one room: the PEFT side (adapters.py) that both trainers, export and the loop share.

The engine's adapter bank (miles/engine/lora.py), the Megatron backend's fused layers
(miles/train/megatron/lora.py) and the weight transport of adapters (miles/weights/lora.py) sit in
their rooms and speak this room's names and config.
"""
