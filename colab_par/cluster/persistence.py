"""Engines that outlive the kernel: the record a later kernel joins them by (`colab_par.cluster.persist`).

`save_record` writes what a `Cluster(persist=True)` is (its options, engines, hosts, devices);
`options_of` and `restore` turn a record back into a cluster's options and state, connected to
the running controller, for `Cluster.attach`.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

import ipyparallel as ipp

from colab_par.cluster import direct, persist
from colab_par.cluster.state import ClusterState
from colab_par.cluster.launchers import launcher_from_state, launcher_state


def record_path(state: ClusterState) -> Any:
    return persist.record_path(state.ipp.profile_dir, state.ipp.cluster_id)


def save_record(state: ClusterState) -> None:
    """What a later kernel needs to join these engines (`colab_par.cluster.persist`)."""
    controller = state.ipp.controller.pid
    options = {key: value for key, value in state.ipp_options.items() if _json_able(value)}
    persist.write_record(record_path(state), {
        "cluster_id": state.ipp.cluster_id, "host": socket.gethostname(), "created": state.created,
        "kernel_pid": os.getpid(), "ipp_cluster_file": state.ipp.cluster_file,
        "controller": {"pid": controller, "started": persist.process_times([controller])[str(controller)]},
        "ids": state.engine_ids, "hosts": [{**info, "local": state.is_local(info)} for info in state.hosts],
        "devices": state.devices, "backend": state.backend, "stack_files": state.stack_files,
        "pids": persist.process_times(state.pids), "generation": state.generation,
        "launcher": launcher_state(state.launcher), "requested_n": state.requested_n,
        "requested_backend": state.requested_backend, "timeout": state.timeout,
        "interrupt_grace": state.interrupt_grace, "dashboard": state.dashboard, "seed": state.seed,
        "ipp_options": options})


def find_record(id: str | None, profile_dir: str | None) -> dict[str, Any]:
    """The record of the newest persisted cluster on this host, or of the one with this `id`."""
    _, record = persist.find_record(id, profile_dir)
    return record


def options_of(record: dict[str, Any]) -> dict[str, Any]:
    """The `Cluster(...)` options the recorded cluster was started with."""
    return dict(n=record["requested_n"], backend=record["requested_backend"],
                launcher=launcher_from_state(record["launcher"]), timeout=record["timeout"],
                interrupt_grace=record["interrupt_grace"], dashboard=record["dashboard"],
                seed=record["seed"], persist=True, **record["ipp_options"])


def restore(state: ClusterState, record: dict[str, Any]) -> None:
    """Connect `state` to the recorded controller, with the recorded engines' ranks, hosts and devices."""
    state.ipp = ipp.Cluster.from_file(record["ipp_cluster_file"], log_level=logging.ERROR)
    state.client = state.ipp.connect_client_sync()
    state.engine_ids, state.backend, state.devices = record["ids"], record["backend"], record["devices"]
    state.hosts = [{k: v for k, v in info.items() if k != "local"} for info in record["hosts"]]
    state.stack_files, state.launched_pids = record["stack_files"], persist.live_pids(record["pids"])
    state.generation, state.created = record["generation"], record["created"]
    state.direct = direct.Channels(state.client)


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
