"""Write 40 records of a small custom task to examples/custom_data/records.jsonl.

The task: a month of notices posted in an office (routine announcements, shuffled and
repeated, ~900 tokens), among which four facts hide: a door code, the guest wifi
password, a meeting room and a new manager's name. The question asks for one of them.
Each record is one JSON line with the fields learnroute reads (context, question,
answers, answer_prefix). There is no `split` field: learnroute splits the records into
calibration and eval by a hash of their content, so this one file serves both training
and the bench. Replace this script by your own export; the format is in the README.

    .venv/bin/python examples/custom_data/make_records.py [OUT]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

NOTICES = [
    "The cafeteria serves soup on Mondays and pasta on Thursdays.",
    "Please return borrowed laptops to the front desk before the weekend.",
    "The second-floor printer is out of toner until further notice.",
    "Visitors sign in at reception and wear a badge at all times.",
    "The fire drill is planned for the first Tuesday of next month.",
    "Bicycles may be parked in the courtyard, not in the hallways.",
    "The quarterly all-hands meeting moves to the large auditorium.",
    "Recycling bins for paper and plastic stand next to the elevators.",
    "The heating in the east wing will be serviced over the holiday.",
    "New employees attend an orientation session on their first morning.",
    "Meeting rooms can be booked through the shared calendar.",
    "The parking garage closes at ten in the evening on weekdays.",
    "The coffee machines on every floor were replaced last week.",
    "The library corner has new books on project management.",
    "Lost and found items are kept at the security office for a month.",
    "Windows in the conference rooms should be closed at night.",
    "The gym in the basement opens at six in the morning.",
    "Packages for staff reach the mail room after lunch.",
    "Expense reports are due by the fifth working day of each month.",
    "The rooftop terrace is closed when it rains or snows.",
]
WORDS = ["maple", "harbor", "falcon", "copper", "meadow", "orchid", "granite", "willow"]
NAMES = ["Ana Novak", "Bruno Costa", "Chloe Duval", "Dario Ferro", "Elif Horvat", "Greta Lund", "Hugo Berg", "Ines Kovac"]
# (question, the sentence that states the fact and is the answer prefix, a value drawer)
FACTS = [
    ("What is the code of the loading dock door?", "The code of the loading dock door is",
     lambda rng: str(rng.randrange(1000, 10000))),
    ("What is the guest wifi password?", "The guest wifi password is",
     lambda rng: f"{rng.choice(WORDS)}{rng.randrange(10, 100)}"),
    ("In which room does the budget review take place?", "The budget review takes place in room",
     lambda rng: str(rng.randrange(100, 1000))),
    ("Who is the new site manager?", "The new site manager is", lambda rng: rng.choice(NAMES)),
]
OUT = Path(__file__).with_name("records.jsonl")


def record(rng: random.Random, repeats: int = 3) -> dict:
    lines = [notice for _ in range(repeats) for notice in rng.sample(NOTICES, len(NOTICES))]
    facts = [(question, stated, draw(rng)) for question, stated, draw in FACTS]
    for _, stated, value in facts:  # each fact at its own random place among the notices
        lines.insert(rng.randrange(len(lines) + 1), f"{stated} {value}.")
    question, stated, value = rng.choice(facts)
    return {
        "context": "Notices posted at the Northgate office this month.\n" + "\n".join(lines),
        "question": question,
        "answer_prefix": stated,
        "answers": [value],
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else OUT
    rng = random.Random(2026)
    rows = [record(rng) for _ in range(40)]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} records to {out}")


if __name__ == "__main__":
    main()
