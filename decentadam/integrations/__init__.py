"""Adapters to other people's training loops: Accelerate and the Hugging Face Trainer.

Import the one you use (each needs its library installed)::

    from decentadam.integrations.accelerate import prepare
    from decentadam.integrations.trainer import DecentralizedTrainer
"""
