"""English text that the lessons' prompts are cut from (see ``core.Text``).

Each source starts with different words, so two prompts share a KV block only where a lesson means them to
(the same system prompt), on any tokenizer.
"""
from __future__ import annotations

SYSTEM = (
    "You are a patient teaching assistant at a workshop about how large language models are served. "
    "Answer in plain English, in two or three short sentences, without lists or code. If a question is "
    "ambiguous, pick the most common meaning and say so. Prefer concrete examples over definitions, keep "
    "numbers approximate, and never invent references. The audience knows Python but not machine learning, "
    "so explain any jargon you use in a few words, and end every answer with one question that checks the "
    "reader understood the main idea.")

OTHER_SYSTEM = (
    "Act as a careful translator between English and French. Keep names, numbers and units unchanged, "
    "preserve the tone of the original, and when an idiom has no direct equivalent, translate its meaning "
    "and add a short note in brackets. Never summarise or shorten the text you are given.")

QUESTIONS = (
    "Question: what is the capital of France, and why did it become the capital?",
    "Tell me why the sky is blue during the day but red at sunset.",
    "How does a bicycle stay upright when it is moving?",
    "Explain what a compiler does to a program before it runs.",
    "Why do cats purr, and do they purr only when they are happy?",
    "Describe how vaccines teach the immune system to fight a virus.",
    "In simple words, what is a black hole and can anything escape it?",
    "Baking question: why does bread rise in a warm kitchen?",
    "Could you explain how a refrigerator keeps food cold?",
    "My daughter asks what causes the seasons on Earth. What should I say?",
    "Bees make honey from flowers; how exactly do they do it?",
    "Please compare weather and climate in one short paragraph.",
    "Salt in the ocean: where does it come from?",
    "Any idea how a battery stores energy and gives it back?",
    "Photosynthesis, explained for a ten year old, please.",
    "Why is it that we dream at night, and does everyone dream?",
)

DOCUMENTS = (
    "Quarterly report. The committee met on a rainy Tuesday to review the results. Sales in the northern "
    "region rose slightly while the southern stores held steady. A new warehouse opened near the river, which "
    "shortened delivery times by a day. Several customers asked for longer opening hours during the holiday "
    "season, and the finance team noted that shipping costs had doubled since the spring.",
    "Meeting notes from the engineering team. Engineers replaced the old ticketing system with a simpler web "
    "form. Staff training on the new tools took two weeks and went mostly smoothly. One supplier was late "
    "three times, so the contract is under review. Energy use in the main office fell after the lighting was "
    "replaced, and the board asked for a plan to reduce returns of damaged goods.",
    "Customer survey summary. Customers rated friendliness highly but waiting times poorly. The pilot of a "
    "loyalty card doubled repeat visits in the test town. Rent for the city-centre shop will rise by a tenth "
    "in January. Two senior managers will retire next year and successors are being trained. Volunteers from "
    "the staff cleaned up the park beside the head office.",
    "A short story. The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small "
    "tin of oil and a cloth. From the top she could see the fishing boats turning home, their lamps like "
    "sparks on the dark water. One night the light would not start, and she had to decide between the radio "
    "and the long walk down to the village.",
    "Travel guide entry. The old town sits on a hill above the harbour, reached by a funicular that has run "
    "since eighteen ninety. Narrow lanes lead to a market square where farmers sell cheese, honey and bread on "
    "Saturday mornings. The castle museum closes early in winter, so visit it first and leave the cafes for "
    "the afternoon.",
    "Recipe. To make a simple tomato soup, soften a chopped onion in olive oil, add two cloves of garlic and a "
    "tin of tomatoes, then simmer with a cup of stock for twenty minutes. Blend until smooth, season with salt "
    "and pepper, and finish with a spoon of cream and a few torn basil leaves.",
    "History lesson. The printing press spread across Europe within a few decades of its invention. Books "
    "became cheaper, more people learned to read, and ideas travelled faster than ever before. Printers "
    "competed to publish pamphlets, calendars and bibles, and scholars could compare identical copies of a text "
    "for the first time.",
    "Science news. Researchers measured the songs of humpback whales across several oceans and found that new "
    "phrases spread from one group to another like fashions. A pattern first heard off Australia appeared in "
    "the songs of whales near Polynesia two years later, carried by animals that met on shared feeding grounds.",
)
