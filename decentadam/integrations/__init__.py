"""Adapters to other people's training loops: Accelerate, the Hugging Face Trainer and fairseq2.

Import the one you use (each needs its library installed; fairseq2 in its own environment)::

    from decentadam.integrations.accelerate import prepare
    from decentadam.integrations.trainer import DecentralizedTrainer
    from decentadam.integrations.fairseq2 import create_trainer    # docs/fairseq2.md
"""
