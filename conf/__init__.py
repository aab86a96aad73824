"""The Hydra config files (YAML): one folder per config group (``model/``, ``data/``,
``trainer/``, ``logger/``, ``experiment/``) and one file per command (``train.yaml``, ...).

This folder holds values, shipped as the package ``symattn_cli.conf``; the typed schemas
those values extend (dataclasses, defaults, comments on each option) are Python, in
:mod:`symattn_cli.configs`.
"""
