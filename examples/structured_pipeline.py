"""Structured output between steps: triage support tickets with JSON passed from one semantic function to the next.

For every ticket, three steps run server-side as one DAG:
  1. ``extract``  -> a JSON object (customer, product, severity) under a JSON schema (a pydantic model),
  2. ``route``    -> exactly one of the team names (a choice constraint), reading the extracted JSON,
  3. ``ticket_id`` -> an id of the form ``ABC-1234`` (a regex constraint).
The engine only generates what each constraint accepts, so the next step always receives valid JSON (and a
``P.json_field`` transform on such an output cannot fail to parse).

    python examples/structured_pipeline.py [--url URL | --local]
"""

import json
from typing import Literal

from _common import open_session, parser
from pydantic import BaseModel, Field

import parrot as P

TEAMS = ["billing", "engineering", "shipping", "account"]
TICKETS = [
    "Hi, this is Maria Lopez. My invoice for the Pro plan charged me twice this month! Please refund one.",
    "The mobile app crashes every time I open the camera screen. - Tom (Android user)",
    "Order for a desk lamp still not delivered after three weeks. Where is it? Regards, Ken Ito",
]


class Extracted(BaseModel):
    customer: str = Field(max_length=40)
    product: str = Field(max_length=40)
    severity: Literal["low", "medium", "high"]


@P.semantic_function(max_tokens=80, json_schema=Extracted)
def extract(ticket: P.SemanticVariable):
    """Extract the customer's name, the product and the severity from this support ticket as JSON.
    Ticket: {{input:ticket}}
    JSON: {{output:fields}}"""


@P.semantic_function(max_tokens=8, choice=TEAMS)
def route(fields: P.SemanticVariable):
    """Which team should handle this ticket: billing, engineering, shipping or account?
    Ticket fields: {{input:fields}}
    Team: {{output:team}}"""


@P.semantic_function(max_tokens=12, regex=r"[A-Z]{3}-[0-9]{4}")
def ticket_id(fields: P.SemanticVariable):
    """Make a ticket id of three capital letters, a dash and four digits for this ticket.
    Ticket fields: {{input:fields}}
    Id: {{output:id}}"""


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    with open_session(args):
        rows = []
        for text in TICKETS:  # everything is submitted before anything is awaited: one DAG per ticket
            fields = extract(text)
            rows.append((fields, route(fields), ticket_id(fields)))
        for (fields, team, tid), text in zip(rows, TICKETS):
            data = json.loads(fields.get(perf=P.LATENCY))
            Extracted.model_validate(data)  # guaranteed by the schema constraint
            print(f"{tid.get(perf=P.LATENCY)}  team={team.get(perf=P.LATENCY):<12} {json.dumps(data)}")
            print(f"    {text[:70]}...")


if __name__ == "__main__":
    main()
