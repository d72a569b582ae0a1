"""Write finetune/assets/dolly-sample.jsonl, the project's own Dolly-format sample.

Every record is generated here from small fact tables and sentence patterns
written for this project, so the sample carries no third-party text. It is
what `finetune gemma --preset tiny` trains on by default: regular enough that
the tiny smoke-test model visibly learns it in a minute on a laptop CPU, and
shaped like Dolly (instruction, context, response, category; about a third of
the records carry a context).

usage: python tools/make_sample_data.py [OUT.jsonl] [--count N]
"""

import argparse
import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Norway": "Oslo",
    "Chile": "Santiago",
    "India": "New Delhi",
    "Spain": "Madrid",
    "Italy": "Rome",
    "Ghana": "Accra",
    "Poland": "Warsaw",
    "Cuba": "Havana",
    "Greece": "Athens",
    "Nepal": "Kathmandu",
    "Austria": "Vienna",
    "Mexico": "Mexico City",
    "Portugal": "Lisbon",
    "Ireland": "Dublin",
    "Sweden": "Stockholm",
    "Vietnam": "Hanoi",
    "Morocco": "Rabat",
    "Argentina": "Buenos Aires",
    "Finland": "Helsinki",
    "Thailand": "Bangkok",
    "Germany": "Berlin",
    "Hungary": "Budapest",
}
ANIMALS = {
    "dolphin": "mammal",
    "whale": "mammal",
    "bat": "mammal",
    "horse": "mammal",
    "eagle": "bird",
    "penguin": "bird",
    "owl": "bird",
    "parrot": "bird",
    "salmon": "fish",
    "shark": "fish",
    "trout": "fish",
    "tuna": "fish",
    "lizard": "reptile",
    "turtle": "reptile",
    "snake": "reptile",
    "crocodile": "reptile",
    "frog": "amphibian",
    "newt": "amphibian",
}
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
ITEMS = ["apples", "books", "coins", "pencils", "stamps", "shells", "marbles", "cards"]
JOBS = ["baker", "pilot", "teacher", "farmer", "nurse", "painter", "engineer", "chef"]
TOWNS = ["Brightwater", "Oakridge", "Millbrook", "Stonehaven", "Redfield", "Ashford"]
ACTIVITIES = {
    "a rainy afternoon": [
        "bake bread",
        "read a novel",
        "play a board game",
        "write letters",
        "build a puzzle",
        "watch an old film",
    ],
    "a summer weekend": [
        "go swimming",
        "have a picnic",
        "ride bikes",
        "visit a market",
        "camp in the garden",
        "fly a kite",
    ],
    "a birthday party": [
        "a treasure hunt",
        "a cake contest",
        "a costume theme",
        "a karaoke hour",
        "a photo booth",
        "a dance game",
    ],
    "learning a language": [
        "label things at home",
        "watch shows with subtitles",
        "find a speaking partner",
        "keep a short diary",
        "learn ten words a day",
        "listen to radio shows",
    ],
    "staying healthy": [
        "walk every day",
        "drink enough water",
        "sleep eight hours",
        "eat more vegetables",
        "stretch in the morning",
        "cook at home",
    ],
}
THINGS = {
    "the sea": ("waves", "blue", "sings"),
    "the moon": ("light", "silver", "glows"),
    "a forest": ("trees", "green", "whispers"),
    "the city": ("streets", "grey", "hums"),
    "winter": ("snow", "white", "sleeps"),
    "a garden": ("flowers", "bright", "grows"),
    "the desert": ("sand", "golden", "waits"),
    "a river": ("water", "clear", "runs"),
}
SYLLABLES = ["ka", "lo", "mi", "ra", "te", "su", "no", "vi", "da", "re", "lin", "mar"]


def make_name(rng):
    first = "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
    last = "".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()
    return f"{first} {last}"


def capital(rng):
    country = rng.choice(sorted(CAPITALS))
    city = CAPITALS[country]
    return dict(
        instruction=f"What is the capital of {country}?",
        context="",
        response=f"The capital of {country} is {city}.",
        category="open_qa",
    )


def addition(rng):
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    return dict(
        instruction=f"What is {a} plus {b}?", context="", response=f"{a} plus {b} is {a + b}.", category="general_qa"
    )


def animal_class(rng):
    animal = rng.choice(sorted(ANIMALS))
    kind = ANIMALS[animal]
    article = "an" if kind[0] in "aeiou" else "a"
    return dict(
        instruction=f"Is a {animal} a mammal, a bird, a fish, a reptile or an amphibian?",
        context="",
        response=f"A {animal} is {article} {kind}.",
        category="classification",
    )


def birth_year(rng):
    name, year = make_name(rng), rng.randint(1850, 2001)
    town, job = rng.choice(TOWNS), rng.choice(JOBS)
    context = f"{name} was born in {year} in {town}. After school, {name.split()[0]} worked as a {job} for many years."
    return dict(
        instruction=f"In which year was {name} born?",
        context=context,
        response=f"{name} was born in {year}.",
        category="information_extraction",
    )


def job_lookup(rng):
    name, year = make_name(rng), rng.randint(1850, 2001)
    town, job = rng.choice(TOWNS), rng.choice(JOBS)
    context = f"{name} grew up in {town} and moved away in {year} to work as a {job}."
    return dict(
        instruction=f"What was the job of {name}?",
        context=context,
        response=f"{name} worked as a {job}.",
        category="closed_qa",
    )


def count_items(rng):
    name = make_name(rng).split()[0]
    item, other = rng.sample(ITEMS, 2)
    n, m = rng.randint(2, 30), rng.randint(2, 30)
    color = rng.choice(COLORS)
    article = "an" if color[0] in "aeiou" else "a"
    context = f"{name} has {n} {item} and {m} {other} in {article} {color} box."
    return dict(
        instruction=f"Using the text, how many {item} does {name} have?",
        context=context,
        response=f"{name} has {n} {item}.",
        category="closed_qa",
    )


def summary(rng):
    town, job = rng.choice(TOWNS), rng.choice(JOBS)
    color, n = rng.choice(COLORS), rng.randint(3, 40)
    context = (
        f"The town of {town} held its yearly fair last week. "
        f"More than {n} stalls were painted {color}, and the prize went to a local {job}. "
        f"Visitors said it was the best fair in years."
    )
    response = f"{town} held a well-liked yearly fair with over {n} {color} stalls, and a local {job} won the prize."
    return dict(
        instruction="Summarize this text in one sentence.", context=context, response=response, category="summarization"
    )


def ideas(rng):
    topic = rng.choice(sorted(ACTIVITIES))
    picks = rng.sample(ACTIVITIES[topic], 3)
    response = "Here are three ideas:\n" + "\n".join(f"- {p}" for p in picks)
    return dict(
        instruction=f"Give me three ideas for {topic}.", context="", response=response, category="brainstorming"
    )


def poem(rng):
    thing = rng.choice(sorted(THINGS))
    noun, color, verb = THINGS[thing]
    response = (
        f"Oh {thing}, so {color} and wide,\n"
        f"your {noun} {'move' if noun.endswith('s') else 'moves'} with every tide.\n"
        f"In quiet hours {thing} {verb},\n"
        f"and keeps the dreams that no one knows."
    )
    return dict(
        instruction=f"Write a short poem about {thing}.", context="", response=response, category="creative_writing"
    )


def kilometres(rng):
    km = rng.randint(1, 90)
    return dict(
        instruction=f"How many meters are there in {km} kilometers?",
        context="",
        response=f"There are {km * 1000} meters in {km} kilometers.",
        category="general_qa",
    )


MAKERS = [capital, addition, animal_class, birth_year, job_lookup, count_items, summary, ideas, poem, kilometres]


def make_records(count, seed=0):
    rng = random.Random(seed)
    return [MAKERS[i % len(MAKERS)](rng) for i in range(count)]


def main():
    here = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=here / "finetune" / "assets" / "dolly-sample.jsonl")
    parser.add_argument("--count", type=int, default=400)
    args = parser.parse_args()
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for record in make_records(args.count):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {args.count} records to {args.out}")


if __name__ == "__main__":
    main()
