"""Time to the same translation quality on a slow network: All-Reduce against decentralized AccumAdam.

As root, from the repository root (the lock keeps other CPU-heavy jobs off the cores)::

    flock /tmp/decentadam-cpu.lock .venv/bin/python -m benchmarks.time_to_quality \\
        --data MULTI30K --steps 600 --eval-every 50

trains the translation recipe's preset (``multi30k-en-de``: 4 ranks as 2 nodes x 2) on the emulated
cluster of ``benchmarks.cluster`` with All-Reduce (DDP + AdamW), AccumAdam on AER and AccumAdam on
the complete graph (``methods``), and reports how long each takes to reach All-Reduce's final
validation loss:

1. Calibration, no network (``launch.calibrate``, ``calibrate`` on the 4 ranks at once): the
   forward + backward of an iteration (C, with its forward share f), the optimizer steps (U_ar of
   AdamW, U_dec of DecentralizedAdam) and the parameter bytes S.
2. The node links' rate (``rates``): the one at which ``decentadam.runtime_model`` puts All-Reduce's
   communication per iteration on 2 nodes x 2 at ``--comm-ratio`` x C (1.5: the paper's
   communication-bound En-De setting); ``--link-mbit`` sets it instead.
3. The emulated cluster at that rate; TCP probes measure the links for the runtime model.
4. Each method (``launch.train``): ``python -m recipes.translation.train`` once per rank in its
   node's namespace, started by ``benchmarks.cluster.launch`` as the cluster benchmark starts its
   workers. Every method runs the same steps from the same seed (initial weights and data order).
5. After teardown, ``python -m eval.bleu`` scores each final checkpoint on the preset's test split
   (``recipes.translation.compare.bleu``).
6. ``benchmarks/results/time_to_quality.{md,json,png}`` (``curves`` analyses, ``notes`` explains
   what the numbers show, ``report`` writes; goals and thresholds in ``benchmarks.thresholds``).

``--render benchmarks/results/time_to_quality.json`` writes the report again from a run's JSON.

Time is the recipe's training time (``train_seconds`` in ``metrics.jsonl``: evaluation, logging
and checkpoints excluded); ms per iteration is measured between the first and the last evaluation,
after the first ``eval_every`` steps. Extra ``key=value`` arguments go to every training.
"""
