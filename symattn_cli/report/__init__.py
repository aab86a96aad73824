"""Reports over many runs: the run files behind some paths, grouped by the config values
that differ between them, as tables (rich, CSV, Markdown, HDF5) and plots.

``runs`` finds and reads run files (also of runs still training, through SWMR); ``groups``
labels each run and aggregates the finished ones of a label; ``tables`` renders the groups;
``plots`` draws them. ``symattn report`` (:mod:`symattn_cli.commands.report`) wires them up.
"""
