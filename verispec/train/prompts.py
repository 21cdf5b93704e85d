"""The prompts a drafter is trained on: written here, from topics and task templates, never
downloaded. The benchmark's chat questions (benchmarks/prompts.py) are none of them, and the
held-out prompts use topics the training never sees."""

from __future__ import annotations

import random

TOPICS: tuple[str, ...] = (
    "volcanoes", "the water cycle", "photosynthesis", "black holes", "the human heart", "honeybees",
    "the Roman Empire", "the printing press", "electric cars", "solar panels", "the internet",
    "machine learning", "chess", "jazz music", "the Olympic Games", "coffee", "bread baking",
    "gardening", "recycling", "public libraries", "the moon landing", "dinosaurs", "earthquakes",
    "the immune system", "vaccines", "antibiotics", "the stock market", "inflation", "budgeting",
    "learning a new language", "public speaking", "time management", "meditation", "running",
    "swimming", "cycling to work", "camping", "the Amazon rainforest", "deserts", "glaciers",
    "coral reefs", "whales", "elephants", "wolves", "owls", "penguins", "ants", "mushrooms",
    "tomatoes", "rice", "chocolate", "cheese making", "pizza", "sushi", "spices", "tea ceremonies",
    "the Great Wall of China", "the pyramids of Giza", "ancient Greece", "the Renaissance",
    "the Industrial Revolution", "trains", "airplanes", "bicycles", "lighthouses", "bridges",
    "skyscrapers", "castles", "museums", "painting", "photography", "origami", "knitting",
    "poetry", "novels", "fairy tales", "theatre", "movies", "video games", "board games",
    "football", "basketball", "tennis", "mountain climbing", "sailing", "the ocean tides",
    "rain", "snow", "thunderstorms", "rainbows at dusk", "the seasons", "clocks", "calendars",
    "maps", "compasses", "the alphabet", "numbers", "fractions", "geometry", "probability",
    "computers", "smartphones", "batteries", "magnets", "electricity", "light", "sound",
    "gravity", "atoms", "the periodic table", "DNA", "evolution", "the solar system", "Mars",
    "comets", "telescopes", "satellites", "rockets", "robots", "3D printing", "cybersecurity",
    "passwords", "email etiquette", "job interviews", "writing a resume", "starting a small business",
    "saving money", "friendship", "kindness", "teamwork", "leadership", "homework", "exams",
    "school lunches", "pets", "dogs", "cats", "goldfish", "horses", "farming", "tractors",
    "windmills", "dams", "rivers", "lakes", "islands", "caves", "forests in autumn", "city parks",
)

# Never in training: the held-out prompts' topics.
HELD_OUT_TOPICS: tuple[str, ...] = (
    "hot air balloons", "submarines", "the violin", "beekeeping", "fireflies", "tsunamis",
    "the Silk Road", "typewriters", "kites", "sand dunes", "marathons", "chess clocks",
)

TEMPLATES: tuple[str, ...] = (
    "Explain {} in simple terms.",
    "What are three interesting facts about {}?",
    "Write a short story about {}.",
    "Write a short poem about {}.",
    "Give me some tips related to {}.",
    "How does {} work?",
    "What is the history of {}?",
    "Why is {} important?",
    "Describe {} to a ten-year-old.",
    "Write a friendly email to a colleague about {}.",
    "What are the pros and cons of {}?",
    "Tell me something surprising about {}.",
    "Write a short blog post introduction about {}.",
    "What questions would a student ask about {}? Answer one of them.",
)


def training_prompts(seed: int = 0) -> list[str]:
    """Every topic under every template, shuffled."""
    prompts = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts(count: int | None = None) -> list[str]:
    """Prompts on topics the training never saw, one template each, in turn."""
    prompts = [TEMPLATES[i % len(TEMPLATES)].format(topic) for i, topic in enumerate(HELD_OUT_TOPICS)]
    return prompts[:count]
