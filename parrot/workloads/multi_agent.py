"""The multi-agent programming workflow of paper §8.4 (MetaGPT-style), written once as data, with the shapes of
Fig. 18: an Architect, one Coder and one Reviewer per file (4-16 files), review-and-revise three times.

    design          = architect(task)
    code[i]^0       = coder_i(task, design)                                    (one task group per stage)
    for r in 1..3:
        review[i]^r = reviewer_i(task, design, code[0..n-1]^(r-1))
        code[i]^r   = reviser_i(task, design, code[0..n-1]^(r-1), review[i]^r)

The shared conversation context is a prompt *prefix* built from generated values: every reviewer and reviser of
round r reads ``task | design | code[0]^(r-1) | ... | code[n-1]^(r-1)`` first (the same text pieces in the same
order, so the same PrefixHash at the boundary after the last file) and only then its own instruction::

    | tag + header | task | design | File 0: | code[0] | ... | File n-1: | code[n-1] | own instruction | <gen> |
                                                                      ^ boundary shared by 2n requests of the round

A :class:`Workflow` is a list of :class:`AgentStep` in topological order (each with its own output length);
every step's output is shown to the user as it comes (MetaGPT streams each role's message), so the Parrot driver
fetches every output with the LATENCY criterion: perf deduction then labels each stage latency-sensitive and
makes its parallel requests a task group. Drivers: :mod:`parrot.sim.experiments` (``multi_agent``) and
:mod:`parrot.bench.multi_agent_bench` (the real engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.workloads.apps import Const, FromStep


@dataclass(frozen=True)
class AgentStep:
    name: str
    template: str  # one output placeholder, named OUT
    inputs: tuple[tuple[str, Const | FromStep], ...]
    max_tokens: int


@dataclass(frozen=True)
class Workflow:
    name: str
    steps: tuple[AgentStep, ...]  # topological order
    finals: tuple[str, ...]  # the steps whose outputs are the app's result (the last revision of every file)

    @property
    def num_calls(self) -> int:
        return len(self.steps)

    @property
    def output_tokens(self) -> int:
        return sum(s.max_tokens for s in self.steps)


@dataclass(frozen=True)
class AgentSizes:
    """Output lengths (tokens) per role; the paper's run used GPT-4-recorded lengths on LLaMA-13B."""

    design: int = 300
    code: int = 180
    review: int = 80
    rounds: int = 3


OUT = "out"
HEADER = ("A software team works on one project. Everyone sees the shared conversation below.\n")


def _context(files: int, version: str) -> tuple[str, tuple[tuple[str, Const | FromStep], ...]]:
    """The shared context's template text and inputs: task, design and every file's code of ``version``."""
    text = HEADER + "Task: {{input:task}}\nArchitect's design: {{input:design}}\nCode of every file:\n"
    text += "".join("File %d:\n{{input:f%d}}\n" % (j, j) for j in range(files))
    inputs = tuple((f"f{j}", FromStep(f"{version}_{j}")) for j in range(files))
    return text, (("task", Const("")), ("design", FromStep("design")), *inputs)


def metagpt_workflow(files: int, task: str, sizes: AgentSizes = AgentSizes(), tag: str = "") -> Workflow:
    """The workflow for ``files`` files (the paper: 4-16) on ``task`` (the user's request text)."""
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    task_ref = Const(task)

    def bind(inputs):
        return tuple((k, task_ref if k == "task" else ref) for k, ref in inputs)

    steps = [AgentStep("design", tag + "You are the Architect. Lay out the project's files and the API of each file."
                       "\nTask: {{input:task}}\nDesign: {{output:%s}}" % OUT, (("task", task_ref),), sizes.design)]
    for i in range(files):
        steps.append(AgentStep(
            f"code0_{i}", tag + HEADER + "Task: {{input:task}}\nArchitect's design: {{input:design}}\n"
            f"You are Coder {i}. Write file {i} following the design.\nCode of file {i}: " + "{{output:%s}}" % OUT,
            (("task", task_ref), ("design", FromStep("design"))), sizes.code))
    for r in range(1, sizes.rounds + 1):
        text, inputs = _context(files, f"code{r - 1}")
        for i in range(files):
            steps.append(AgentStep(
                f"review{r}_{i}", tag + text + f"You are Reviewer {i}. Review file {i}: bugs, API mismatches, style."
                "\nComments: {{output:%s}}" % OUT, bind(inputs), sizes.review))
        for i in range(files):
            steps.append(AgentStep(
                f"code{r}_{i}", tag + text + "Comments on file %d: {{input:review}}\nYou are Coder %d. Revise file "
                "%d following the comments.\nRevised code of file %d: {{output:%s}}" % (i, i, i, i, OUT),
                (*bind(inputs), ("review", FromStep(f"review{r}_{i}"))), sizes.code))
    finals = tuple(f"code{sizes.rounds}_{i}" for i in range(files))
    return Workflow(f"metagpt{files}", tuple(steps), finals)
