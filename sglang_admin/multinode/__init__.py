"""One model replica over several hosts (``--nnodes``, ``--node-rank``, ``--dist-init-addr``).

docs/multinode.md has the design, the launch lines and the fault table. ``wire`` carries
the TP group's commands without pickle (on one host too), ``topology`` checks the flags and
places the ranks, ``link`` is the nodes' join check and liveness, ``group`` joins a
replica's torch.distributed group across hosts, ``server/node_server.py`` runs a node past the first.
"""
