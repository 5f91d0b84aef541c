"""Operating the pipeline on one machine: the local stack of servers and workers (``python -m ops.localstack``).

Above the flows (it deploys them) and apart from the stage functions, which never start or stop servers.
"""
