"""``squeezeserve validate``: compare a candidate model against its baseline on accuracy, latency and size.

Open ``job.py`` first: it runs the stages in order. ``accuracy.py`` (perplexity, KL, top-1 agreement,
task accuracy), ``latency.py`` (streaming load generator), ``size.py``, ``gates.py``, ``report.py`` and
``plots.py`` each hold one stage; ``specs.py`` says how a model is named on the command line.
"""
