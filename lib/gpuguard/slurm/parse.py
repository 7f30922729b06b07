"""What Slurm prints about nodes and jobs, parsed (pure): `scontrol show node|job -o` and `sinfo -N`, into
NodeState / NodeRow and {key: value} dicts. Tested on recorded outputs (tests/unit/test_slurm_client.py)."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Optional

from gpuguard.util.record import Frozen, Record, field, record
from gpuguard.util.lazyre import lazy


@record
class NodeState(Record):
    name: str
    states: frozenset[str] = frozenset()  # {"IDLE", "DRAIN", ...} from State=IDLE+DRAIN
    reason: Optional[str] = None  # the reason text without Slurm's " [user@time]" suffix
    reason_user: Optional[str] = None
    reason_time: Optional[str] = None
    boot_time: Optional[str] = None
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def drained(self) -> bool:
        return bool({"DRAIN", "DRAINED", "DRAINING"} & self.states)

    @property
    def down(self) -> bool:
        return "DOWN" in self.states

    @property
    def maintenance(self) -> bool:
        # An admin's maintenance reservation or a pending reboot: hands off. A plain (user) reservation is not:
        # a broken node in a big run's reservation must still be drained.
        return bool({"MAINTENANCE", "MAINT", "REBOOT_REQUESTED", "REBOOT_ISSUED", "POWERING_DOWN"} & self.states)



# --------------------------------------------------------------------------- parsing `scontrol show ... -o`
# Verified on 22.05 (see devcluster.py): Reason comes last, verbatim (spaces, ':', '=', '[...]' unescaped),
# followed by Slurm's " [user@time]" stamp. Parse the plain -o form: every Slurm version prints it.

# A key as `scontrol show ... -o` prints them: `NodeName`, `Socks/Node`, `ReqB:S:C:T`, `NtasksPerN:B:S:C`.
_KEY_AT = lazy(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
# Slurm appends who set a node's reason and when: `Reason=Prolog error [root@2024-05-01T10:00:00]`.
_REASON_STAMP = lazy(r"\s\[([^\[\]\s@]+)@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d|Unknown|None)\]")


def _split_fields(text: str) -> dict[str, str]:
    """Split `Key=value Key2=value with spaces` at each ` Key=`; the first occurrence of a key wins.

    A value containing ` Word=` is split wrongly here; callers fix the free-text fields they know about.
    """
    line = " ".join(text.strip().splitlines())
    fields: dict[str, str] = {}
    matches = list(_KEY_AT.finditer(line))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        fields.setdefault(match.group(1), line[match.end() : end].rstrip())
    return fields


def parse_node_line(text: str) -> dict[str, str]:
    """Parse one node of `scontrol show node -o` into {key: value}.

    `Reason` is free text an admin typed (spaces, `=`, `:` and `[...]` allowed), so it is cut out first, up to the
    ` [user@time]` stamp Slurm appends; the stamp goes to `ReasonUser` / `ReasonTime`. Everything after the stamp
    (e.g. `Comment=`) is parsed normally.
    """
    line = " ".join(text.strip().splitlines())
    reason_at = re.search(r"(?:^|\s)Reason=", line)
    if reason_at is None:
        return _split_fields(line)
    head, tail = line[: reason_at.start()], line[reason_at.end() :]
    fields = _split_fields(head)
    stamp = _stamp_ending_reason(tail)
    if stamp is None:
        # No stamp (not seen in 22.05, but cheap to survive): the reason runs to the end of the line.
        fields["Reason"] = tail.strip()
        return fields
    fields["Reason"] = tail[: stamp.start()].strip()
    fields["ReasonUser"], fields["ReasonTime"] = stamp.group(1), stamp.group(2)
    for key, value in _split_fields(tail[stamp.end() :]).items():
        fields.setdefault(key, value)
    return fields


def _stamp_ending_reason(tail: str) -> Optional[re.Match[str]]:
    """The first `[user@time]` stamp that is followed by the end of the line or by another ` Key=`."""
    for stamp in _REASON_STAMP.finditer(tail):
        rest = tail[stamp.end() :]
        if not rest.strip() or _KEY_AT.match(rest.lstrip()):
            return stamp
    return None


def parse_node_lines(text: str) -> dict[str, dict[str, str]]:
    """Parse all of `scontrol show node -o` (one node a line) into {node name: fields}."""
    nodes = {}
    for line in text.splitlines():
        if line.strip():
            fields = parse_node_line(line)
            nodes[fields.get("NodeName", "")] = fields
    return nodes


# The user picks a job's name, and scontrol prints it unescaped right before `UserId=name(uid) GroupId=`.
_JOB_NAME = lazy(r"(?:^|\s)JobName=(.*?) UserId=(\S*\(\d+\)) GroupId=")


def parse_job_line(text: str) -> dict[str, str]:
    """Parse one job of `scontrol show job -o` into {key: value}.

    A value is everything up to the next ` Key=`, so values with spaces (`Command`, paths) are kept whole.
    `JobName` (user-chosen, may even contain ` Key=`) is cut out first, anchored on the `UserId=name(uid)` that
    always follows it. Other free text (`Comment=`) containing ` Key=` cannot be told apart from a real field in
    this format; the first occurrence of each key wins. A job's `Reason` is a fixed word (`BeginTime`, `None`,
    `launch_failed_requeued_held`).
    """
    line = " ".join(text.strip().splitlines())
    name = _JOB_NAME.search(line)
    if name is None:
        return _split_fields(line)
    fields = _split_fields(line[: name.start()])
    fields["JobName"] = name.group(1)
    for key, value in _split_fields(line[name.end(1) :]).items():
        fields.setdefault(key, value)
    return fields


def parse_job_lines(text: str) -> list[dict[str, str]]:
    return [parse_job_line(line) for line in text.splitlines() if line.strip()]


def node_state_flags(state: str) -> set[str]:
    """`IDLE+DRAIN+MAINTENANCE+RESERVED` -> {"IDLE", "DRAIN", "MAINTENANCE", "RESERVED"} (Slurm's `*` suffix =
    not responding)."""
    flags = {part for part in state.rstrip("*").split("+") if part}
    if state.endswith("*"):
        flags.add("NOT_RESPONDING")
    return flags


def node_state_from_fields(f: dict[str, str]) -> NodeState:
    reason = f.get("Reason")
    if reason in ("", "(null)", "None"):
        reason = None
    return NodeState(name=f.get("NodeName", ""), states=frozenset(node_state_flags(f.get("State", ""))),
                     reason=reason, reason_user=f.get("ReasonUser"), reason_time=f.get("ReasonTime"),
                     boot_time=f.get("BootTime"), fields=f)


@record
class NodeRow(Frozen):
    """One node in one partition, as `sinfo -N` lists it: what the drain-storm guard counts."""

    node: str
    partition: str
    state: str  # sinfo's long state, lower case: idle, drained, draining, mixed, down*, ...
    reason: Optional[str]
    reason_time: Optional[str]  # 2026-11-25T18:35:50 (local time, as Slurm prints it) or None
    comment: Optional[str] = None  # the node's Comment (the storm guard's marks live there); None: not read

    @property
    def drained(self) -> bool:
        return "drain" in self.state


def slurm_time(text: Optional[str]) -> Optional[float]:
    """Slurm's `ReasonTime=2026-11-24T17:53:20` (printed in local time, no zone) -> epoch seconds."""
    if not text or text in ("None", "Unknown", "(null)"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()  # naive: local time, as Slurm printed it
    except ValueError:
        return None


# Node name, partition, long state, reason time, reason (last: free text that may hold the separator).
SINFO_CENSUS_FORMAT = "%N|%P|%T|%H|%E"
# The same and the node's Comment (`sinfo -O`, Slurm >= 20.11), fields ended by the ASCII unit separator, which
# neither a reason gpuguard writes nor any sane comment holds; the reason is still last.
CENSUS_SEP = "\x1f"
SINFO_CENSUS_FIELDS = ",".join(f"{name}:0{CENSUS_SEP}" for name in
                               ("NodeList", "Partition", "StateLong", "Timestamp", "Comment")) + ",Reason:0"


def parse_sinfo_census(text: str) -> list[NodeRow]:
    """`sinfo -h -N -o '%N|%P|%T|%H|%E'` -> rows. The default partition's `*` is dropped; 'none'/'Unknown' are
    no reason / no time."""
    rows = []
    for line in text.splitlines():
        parts = line.rstrip("\n").split("|", 4)
        if len(parts) != 5 or not parts[0].strip():
            continue
        node, part, state, when, reason = (x.strip() for x in parts)
        rows.append(NodeRow(node=node, partition=part.rstrip("*"), state=state.lower(),
                            reason=None if reason in ("", "none", "(null)") else reason,
                            reason_time=None if when in ("", "Unknown", "None", "(null)") else when))
    return rows


def parse_sinfo_census_fields(text: str) -> list[NodeRow]:
    """`sinfo -h -N -O SINFO_CENSUS_FIELDS` -> rows, with each node's Comment ('(null)': none)."""
    rows = []
    for line in text.splitlines():
        parts = line.split(CENSUS_SEP, 5)
        if len(parts) != 6 or not parts[0].strip():
            continue
        node, part, state, when, comment, reason = (x.strip() for x in parts)
        rows.append(NodeRow(node=node, partition=part.rstrip("*"), state=state.lower(),
                            reason=None if reason in ("", "none", "(null)") else reason,
                            reason_time=None if when in ("", "Unknown", "None", "(null)") else when,
                            comment="" if comment in ("(null)", "''") else comment))
    return rows
