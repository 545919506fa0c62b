"""Cluster-scale goodput simulator for nonuniform tensor parallelism (NTP).

Compares what a job keeps of its throughput when GPUs fail under three
policies, on the same sampled failures (Arfeen et al., arXiv:2504.06095: its
motivation and its large-scale evaluation):

* ``dp-drop``: a data-parallel (DP) replica with any failed GPU stops.
* ``ntp``: the replica runs at the tensor-parallel (TP) degree of its most
  failed pipeline stage, with its batch share reduced in proportion.
* ``ntp-pw``: as ``ntp``, and the reduced domains are power-boosted so the
  replica keeps pace with healthy ones where the boost limit allows.

Pure numpy (and matplotlib for plots): nothing here imports JAX. The command
line is ``python -m ntp_jax.sim --help``; see ``docs/simulator.md``.
"""

from ntp_jax.sim.cluster import ClusterSpec
from ntp_jax.sim.degrees import DegreeRule
from ntp_jax.sim.failures import FailureModel, Timeline, sample_timeline
from ntp_jax.sim.placement import failed_gpus_for_fraction, sample_failed_counts
from ntp_jax.sim.planner import ReplicaPlan, global_batch_fractions, plan_replicas
from ntp_jax.sim.policies import (
                                  Policy,
                                  PolicySettings,
                                  job_capacity,
                                  replica_shares,
                                  throughput_loss,
)
from ntp_jax.sim.power import PowerCurve
from ntp_jax.sim.spares import SparesResult, spares_needed
from ntp_jax.sim.sweep import LossPoint, loss_sweep
from ntp_jax.sim.timeline import AvailabilityTimeline, availability_timeline

__all__ = [
    "AvailabilityTimeline",
    "ClusterSpec",
    "DegreeRule",
    "FailureModel",
    "LossPoint",
    "Policy",
    "PolicySettings",
    "PowerCurve",
    "ReplicaPlan",
    "SparesResult",
    "Timeline",
    "availability_timeline",
    "failed_gpus_for_fraction",
    "global_batch_fractions",
    "job_capacity",
    "loss_sweep",
    "plan_replicas",
    "replica_shares",
    "sample_failed_counts",
    "sample_timeline",
    "spares_needed",
    "throughput_loss",
]
