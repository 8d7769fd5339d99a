"""Gradient compression through DDP's communication hooks: fp16 / bf16 and PowerSGD, by name (lesson 18)."""
