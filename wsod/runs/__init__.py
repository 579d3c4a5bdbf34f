"""The entry points, importable: what the scripts in tools/ run, a composed config in, a directory out.
``wsod.build`` turns the config into objects (data, models, loaders, checkpointers, companions); these
modules read only what is their own (the run directory, the resume policy, logging, the settings of the
loop or of the command). One module per entry point, nothing re-exported here:

- ``prologue``: what every entry point shares (``run_in_directory``: device, threads, the output
  directory chosen, locked and claimed, ``log.txt``, ``error.txt``), the run directory of a sweep's job
  (``sweep_job_dir``, the ``wsod_folder_name`` resolver, ``DiscardMultirunYaml``);
- ``train``: tools/train.py (``train_from_config``), and what every training entry point shares (the
  run directory and resume, ``config.yaml``, the loop and the final evaluation);
- ``evaluate``: tools/eval.py (``evaluate_from_config``);
- ``predict``: tools/predict.py (``predict_from_config``);
- ``export``: tools/export_pseudo_labels.py (``export_from_config``), the second stage's pseudo boxes;
- ``stage2``: tools/train_stage2.py (``train_stage2_from_config``), the second stage's training.
"""
