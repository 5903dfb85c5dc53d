"""Time to the same translation quality on a slow network: DecentralizedAdam against float32 DDP and
what a user would pick instead, every method and seed in one invocation on one machine.

As root, from the repository root (nothing else CPU-heavy on the cores while it runs)::

    .venv/bin/python -m benchmarks.time_to_quality --data MULTI30K --best nodes-complete-bf16 \\
        --steps 1200 --eval-every 100

trains the translation recipe's preset (``multi30k-en-de``: 4 ranks as 2 nodes x 2) on the emulated
cluster of ``benchmarks.cluster`` with each method of ``methods``: DDP + AdamW in float32
(``allreduce``), with ``bf16_compress_hook`` (``allreduce-bf16``), with PowerSGD (``powersgd``),
post-local SGD (``postlocal``), the seed authors' decent-dp (``decent-dp``; ``alternatives`` runs
these four in the recipe's loop), and DecentralizedAdam with the library's default setting as it is
at run time (``decentadam-default``) and with the setting ``--best`` names (``decentadam-best``);
then reports how long each takes to reach the final validation loss of float32 DDP with the same seed:

1. Calibration, no network (``launch.calibrate``, ``calibrate`` on the 4 ranks at once): the
   forward + backward of an iteration (C) and the parameter bytes S.
2. The node links' rate (``rates``): the one at which ``decentadam.runtime_model`` puts DDP's
   communication per iteration on 2 nodes x 2 at ``--comm-ratio`` x C (1.5: the paper's
   communication-bound En-De setting); ``--link-mbit`` sets it instead. One calibration and one rate
   for every training.
3. The emulated cluster at that rate, for the whole run.
4. Every method with every seed (``--seeds``, default 1 and 2: the seed-to-seed spread is the error
   bar) and rate (``--lr-grid``; default the preset's), in the order of ``methods.run_order``: the
   methods in order for the first seed and reversed for the second, so All-Reduce runs first and
   last and a drift of the machine hits every method alike on the mean of two seeds. Each training
   (``launch.train``) is one process per rank in its node's namespace, started by
   ``benchmarks.cluster.launch``, from the seed's initial weights and data order; the machine's load
   meanwhile is recorded (``launch.LoadMeter``).
5. After each seed's trainings, ``python -m eval.bleu`` scores each run's final checkpoint and its
   last checkpoint within DDP's training time of that seed (``cli.score``).
6. ``benchmarks/results/time_to_quality/time_to_quality.{md,json,png}`` (``curves`` analyses,
   ``notes`` judges the default's goals, ``report`` writes; thresholds in ``benchmarks.thresholds``).

``--render JSON`` writes the report again from a run's JSON; ``--predict-scale RUNS`` predicts each
parity-grid method's time to quality at 16 and 32 nodes on the paper's cluster (``scale``).

Time is the recipe's training time (``train_seconds`` in ``metrics.jsonl``: evaluation, logging
and checkpoints excluded); ms per iteration is measured between the first and the last evaluation,
after the first ``eval_every`` steps. Extra ``key=value`` arguments go to every training.
"""
