"""Generate JSON for a schema, validate it server-side, retry with the error in the prompt (issue 34): one flow.

Each attempt the model writes a JSON object; the server tool ``json_validate`` checks it against the schema
(``on_error="value"``: an invalid answer becomes the value ``"error: <what is wrong>"`` instead of failing the
flow); the loop stops at the first valid answer, else feeds the error back into the next prompt. After
``--attempts`` failures the loop's outputs fail (``on_max="error"``, cause ``loop_max_steps``): this script
catches that typed error and says so.

    python examples/refine_until_valid.py [--url URL | --local] [--attempts 3] [--max-tokens 48] [--task TEXT]
"""

from __future__ import annotations

import json
import time

from _common import open_session, parser

import parrot as P

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "height_m": {"type": "number"}, "year_lit": {"type": "integer"}},
    "required": ["name", "height_m", "year_lit"],
}
EXAMPLE = '{"name": "Eddystone", "height_m": 49, "year_lit": 1882}'
TASK = "a famous lighthouse of France"


@P.semantic_function(max_tokens=48, stop=["\n\n"], transforms=[P.replace("\n", " "), P.strip()])
def draft(task: P.SemanticVariable, feedback: P.SemanticVariable):
    """Describe {{input:task}} as a JSON object with the keys "name" (a string), "height_m" (a number) and
    "year_lit" (an integer).
    {{input:feedback}}
    JSON: {{output:candidate}}"""


def make_refine(attempts: int, max_tokens: int):
    """The traced function: ``refine(task, schema) -> {"json", "feedback"}``, valid JSON or failed outputs."""
    write = draft.options(max_tokens=max_tokens)

    def refine(task, schema):
        def attempt(feedback):
            candidate = write(task, feedback)
            checked = P.tool("json_validate", value=candidate, schema=schema, on_error="value")
            retry = P.text("Your previous answer {{input:c}} was rejected ({{input:e}}). Write a corrected one.",
                           c=candidate, e=checked)
            return {"feedback": retry, "json": checked}

        return P.loop(attempt, carry={"feedback": f"For example, for the Eddystone lighthouse: {EXAMPLE}"}, max_steps=attempts, on_max="error",
                      until=lambda out: ~out["json"].matches(r"^error:"), name="refine")

    return refine


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--task", default=TASK)
    args = p.parse_args()
    with open_session(args):
        t0 = time.perf_counter()
        run = P.flow(make_refine(args.attempts, args.max_tokens), args.task, json.dumps(SCHEMA),
                     name="refine_until_valid")
        try:
            valid = run.outputs["json"].get(perf=P.LATENCY)
        except P.StepFailed as e:
            status = run.wait(timeout=120)
            print(f"no valid JSON after {run.iterations(status)} attempts (cause {e.cause_code}): "
                  f"{(status.get('error') or {}).get('message', e.message)}")
        else:
            print(f"valid JSON: {valid}")
            print(f"attempts: {run.iterations(run.wait(timeout=120))}")
        print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
