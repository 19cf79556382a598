"""Held-out chat prompts of another kind than code, for the SmolLM2 recipe's second
evaluation set (docs/training.md, "Learning on a real model"): a drafter trained on coding
replies is judged on HumanEval and on these, so that its τ is not one benchmark's alone.

    python bench/chat_prompts.py OUT.jsonl

Sixty single-turn requests written for this project, ten in each of six kinds that chat
benchmarks such as MT-Bench group their questions into (writing, explanation, reasoning,
arithmetic, extraction and rewriting, advice), none about code. No registry serves a chat
evaluation set in a package here, and a fixed list in the repository is the same set on
every machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WRITING = [
    "Write a short poem about the first snow of winter in a small town.",
    "Write a thank-you note to a neighbour who watered my plants while I was away.",
    "Write a two-paragraph story about a lighthouse keeper who finds a message in a bottle.",
    "Write a product description for a reusable water bottle that keeps drinks cold.",
    "Write a friendly email inviting my team to a picnic next Saturday.",
    "Write a short speech for a friend's wedding, warm and a little funny.",
    "Write a diary entry of a cat watching rain through the window.",
    "Write the opening paragraph of a mystery novel set on a night train.",
    "Write a limerick about a forgetful wizard.",
    "Write a short advertisement for a neighbourhood bakery's new bread.",
]
EXPLANATION = [
    "Explain why the sky is blue to a ten-year-old.",
    "Explain how vaccines train the immune system.",
    "What causes the seasons on Earth?",
    "Explain the difference between weather and climate.",
    "How does a refrigerator keep food cold?",
    "Why do leaves change colour in autumn?",
    "Explain what inflation is and why it matters to households.",
    "How do airplanes stay in the air?",
    "What is photosynthesis and why is it important?",
    "Explain how the moon causes tides.",
]
REASONING = [
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "A farmer has 17 sheep and all but 9 run away. How many are left? Explain your answer.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron? Why?",
    "Tom is taller than Anna, and Anna is taller than Ben. Who is the shortest, and why?",
    "If it takes five machines five minutes to make five widgets, how long would it take "
    "one hundred machines to make one hundred widgets?",
    "I have two coins that add up to 30 cents and one of them is not a nickel. What are they?",
    "A bat and a ball cost 1.10 dollars in total. The bat costs one dollar more than the "
    "ball. How much does the ball cost?",
    "What comes next in the sequence 2, 6, 12, 20, 30, and why?",
    "If today is Wednesday, what day of the week will it be in 100 days?",
    "Three friends split a bill of 90 dollars equally, then get 15 dollars back. How much "
    "did each pay in the end?",
]
ARITHMETIC = [
    "What is 15 percent of 240? Show your working.",
    "A train travels 180 kilometres in 2.5 hours. What is its average speed?",
    "Convert 72 degrees Fahrenheit to Celsius and explain the formula.",
    "If I save 250 dollars a month, how much will I have after three years?",
    "A recipe for 4 people needs 300 grams of flour. How much is needed for 10 people?",
    "What is the area of a circle with a radius of 7 centimetres?",
    "A shirt costs 40 dollars after a 20 percent discount. What was the original price?",
    "How many seconds are there in a week?",
    "Solve for x: 3x + 7 = 22.",
    "What is the average of 12, 18, 25, 31 and 44?",
]
EXTRACTION = [
    "Summarise in two sentences: The city council met on Monday to discuss the new park. "
    "Residents asked for more trees and a playground, while some worried about parking. "
    "The council agreed to publish a revised plan next month.",
    "Rewrite this sentence in a formal tone: hey, can u send me the report asap?",
    "List the countries mentioned in this text: Last summer we drove from France to Spain, "
    "then flew to Italy before taking a ferry to Greece.",
    "Turn these notes into a short paragraph: meeting moved to Friday; bring budget numbers; "
    "Maria presents the survey results.",
    "Correct the grammar of this sentence: Me and him goes to the store yesterday.",
    "Give three keywords that describe this review: The hotel was clean and quiet, the staff "
    "were kind, but breakfast was expensive.",
    "Translate into simple English: The aforementioned individual shall remit payment forthwith.",
    "Make this paragraph shorter without losing its meaning: Our company, which was founded "
    "many years ago in the year 1998, has always been committed to providing high quality "
    "products to all of our many customers.",
    "Classify the sentiment of this sentence as positive, negative or neutral: The movie was "
    "long, but the ending made it worth it.",
    "Extract the date and place from this invitation: Join us on June 14th at the Riverside "
    "Community Hall for an evening of music.",
]
ADVICE = [
    "Give me five tips for sleeping better.",
    "How can I prepare for a job interview?",
    "What are some good ways to learn a new language as an adult?",
    "Suggest a simple weekly plan for someone who wants to start running.",
    "How do I keep houseplants alive when I travel often?",
    "What should I pack for a three-day hiking trip?",
    "Give me ideas for a rainy-day activity with young children.",
    "How can I make my morning routine less stressful?",
    "What are healthy snacks I can take to work?",
    "How should I start saving money if I have never had a budget?",
]
PROMPTS = WRITING + EXPLANATION + REASONING + ARITHMETIC + EXTRACTION + ADVICE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    lines = (json.dumps({"messages": [{"role": "user", "content": p}]}) for p in PROMPTS)
    args.output.write_text("".join(line + "\n" for line in lines))
    print(f"{len(PROMPTS)} prompts in {args.output}")


if __name__ == "__main__":
    main()
