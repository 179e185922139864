"""Labs: write a piece of the engine yourself, check it, then watch it run beside the engine's own.

``minipaged lab list`` shows them; ``minipaged lab start N`` writes a stub with TODOs and a one-page guide into
the working folder; ``minipaged lab check N`` runs the lab's checks on the student's file, with messages that
explain each mistake; ``minipaged watch --lab N`` runs the student's code inside the live engine, side by side
with the reference. docs/labs.md says how a teacher runs them in a workshop.
"""
from __future__ import annotations

from .core import CheckResult, Lab, LabFailure, check_file, load_target, run_checks


def all_labs() -> list[Lab]:
    """Every lab, in order (imported here, on demand: labs 4 and 5 need torch)."""
    from . import (lab1_lru_queue, lab2_block_hash, lab3_priority, lab4_rejection_sampler, lab5_paged_attention,
                   lab6_preemption, lab7_schedule)
    return [m.LAB for m in (lab1_lru_queue, lab2_block_hash, lab3_priority, lab4_rejection_sampler,
                            lab5_paged_attention, lab6_preemption, lab7_schedule)]


def find_lab(number: int) -> Lab:
    labs = all_labs()
    for lab in labs:
        if lab.number == number:
            return lab
    raise ValueError(f"there is no lab {number}; the labs are {', '.join(str(lab.number) for lab in labs)} "
                     f"(minipaged lab list).")


__all__ = ["CheckResult", "Lab", "LabFailure", "all_labs", "check_file", "find_lab", "load_target", "run_checks"]
