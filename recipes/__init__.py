"""Training recipes built on decentadam's public API, and the scaffolding they share.

``recipes.common`` holds what every recipe needs and none documents (configuration, the run
directory, the optimizer builder, the launch command, the training clock); ``recipes.translation`` and
``recipes.imagenet`` each keep their own data, model and explicit training loop.

The recipes are installed with ``decentadam`` (``pip install 'decentadam[recipes]'``, which also
installs the command ``decentadam-train``, :mod:`recipes.commands`); run them as modules, from the
repository root or from any directory once installed, directly or under ``accelerate launch``::

    python -m recipes.translation.train --preset multi30k-en-de data=DIR
    accelerate launch --num_processes 4 -m recipes.translation.train --preset multi30k-en-de data=DIR
"""
