"""Elastic sites on torchft (`--lsgd-fault-tolerance torchft`, docs/fault_tolerance.md).

Each site is one torchft replica group: every rank of the site runs a torchft `Manager`
client (the site's rank 0 also runs the manager server that talks to the lighthouse), and
its cross-site traffic goes through the Manager's reconfigurable process group, in which
the rank's position is its dp_inter position. `TorchftMembership` is what the local-SGD
synchronizers see (membership.SiteMembership): a quorum before each round, the mean over
the sites present, commit or roll back at the end; a reduction that overlaps inner steps
issued after the next step's quorum (its rhythm, the same calls as a plain run's).

Modules: `options` (flags, checks), `elastic_comm` (InterSiteComm over the torchft group),
`torchft_membership` (quorum, floor, commit/rollback, healing state, `Heal`s).
"""
