"""The command-line flags of cluster trust, shared by the proxy and every worker."""

from __future__ import annotations

import argparse

from engine_core.cluster.trust import ClusterSecret, load_secret_file


def add_cluster_trust_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the cluster secret, for every process of the internal plane."""
    parser.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                        help="file holding the cluster secret that authenticates registration "
                             "and KV control messages and signs transfer grants (or "
                             "PDSERVE_CLUSTER_SECRET_FILE; `pdserve launch` makes one)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding a non-loopback address without a cluster secret "
                             "(anyone who reaches the internal ports can then register "
                             "workers and read KV)")


def cluster_secret_from_args(args: argparse.Namespace) -> ClusterSecret:
    """The secret in ``--cluster-secret-file`` (ConfigError when unreadable), else none."""
    path = args.cluster_secret_file
    return load_secret_file(path) if path else ClusterSecret()
