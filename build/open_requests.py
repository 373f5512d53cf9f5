"""Open-ended chat requests: what people ask a chat model without pasting a document (stage 6 of the EAGLE head).

``build/chat_requests.py``'s other kinds hand the model a passage, a function or a JSON document from the
corpora, or a raw opening to continue; its few open-ended templates (``topic``, ``describe``, ``class``) make
only about 120-200 distinct requests, all used up by the first request set, so later sets had none. Measured
on the stage-5 head (held-out answers of stage 5's set, top-1 agreement): prose ``raw`` 0.71 but ``define``
0.43 and ``saying`` 0.38; the benchmark's open-ended chat answers 0.34 (prose) / 0.45 (code). This module
composes many distinct open-ended asks per domain from slot lists (forms x subjects x details), so a set of
thousands has few repeats.

The benchmark's held-out requests (``client/specdec_client/bench_prompts.py`` CHAT_REQUESTS) are never made:
each names one of ``BENCHMARK_SUBJECTS``, and ``chat_requests.py`` drops every open request that names one too
(``names_benchmark_subject``: "a binary search tree" goes, for "binary search"; the slot lists stay as they
were when stage 6's set was made, so its seed rebuilds the same requests under the same ids).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

Request = dict[str, object]

# Subjects of the benchmark's held-out requests: none of the slot values below may mention one (tested).
BENCHMARK_SUBJECTS = ("tea", "lost dog", "rainbow", "neighbour", "storm", "lighthouse", "walking", "music",
                      "train station", "hotel", "programming languages", "weather", "smartphone", "web server",
                      "school class", "Maria", "Porto", "flight", "binary search", "counts the words", "Fibonacci",
                      "flatten", "email address", "stack", "duplicate", "most common")

PROSE_SUBJECTS = (
    "the history of coffee", "the history of the bicycle", "the history of paper", "the history of chess",
    "the Roman roads", "the Silk Road", "the first telephones", "the history of maps", "ancient Egypt's pyramids",
    "the invention of the clock", "the history of glass", "the first cars", "how cities grew around rivers",
    "volcanoes", "coral reefs", "the moon", "deserts", "the Arctic", "rain forests", "honeybees", "owls",
    "octopuses", "whales", "ants", "penguins", "elephants", "autumn leaves", "earthquakes", "glaciers",
    "solar energy", "recycling", "public parks", "museums", "board games", "cooking at home", "learning a language",
    "keeping a journal", "saving money", "time management", "teamwork", "kindness", "curiosity", "courage",
    "friendship", "growing tomatoes", "baking bread", "camping", "swimming",
    "cycling to work", "painting with watercolours", "photography", "chess", "gardening", "reading before bed",
    "the internet", "space exploration", "the ocean's tides", "clouds", "snow", "the human heart", "sleep",
    "vaccines", "electricity", "magnets", "the printing press", "maps and navigation", "the post office",
    "a village festival", "street food", "bridges", "castles", "windmills", "forests in winter",
)
PROCESSES = ("a bicycle's gears work", "bread rises", "a refrigerator keeps food cold", "plants make food from light",
             "the heart pumps blood", "a compass finds north", "bees make honey", "a volcano erupts",
             "the seasons change", "a plane stays in the air", "a battery stores energy", "vaccines protect us",
             "clouds form", "a camera takes a picture", "recycling turns old paper into new paper",
             "the moon changes shape in the sky", "a seed becomes a tree", "ice melts", "soap cleans hands",
             "tides rise and fall", "a bridge holds its weight", "the internet sends a message",
             "a thermometer measures temperature", "a caterpillar becomes a butterfly", "our eyes see colour")
AUDIENCES = ("a curious child", "a new student", "a beginner", "an elderly relative", "a busy adult",
             "a classroom of teenagers")
CHARACTERS = ("a young baker", "an old fisherman", "a shy robot", "a girl who loves maps", "a retired teacher",
              "a clever fox", "a boy and his grandfather", "a cat who lives in a library", "two rival chefs",
              "a mail carrier", "a tired astronaut", "a street musician's apprentice", "a farmer",
              "a lonely dragon", "a nurse on a night shift", "a small owl", "a king who cannot sleep",
              "a girl who builds kites", "an inventor", "a pair of twins")
SITUATIONS = ("who finds a mysterious key", "on the first day of a new job", "who gets lost in a big city",
              "who must cross a river", "who discovers a hidden garden", "during a power cut",
              "who wins a surprising prize", "who learns to be patient", "who makes an unlikely friend",
              "on a long journey by boat", "who forgets something important", "who has to keep a secret",
              "at a winter market", "who fixes something broken", "who moves to a new town",
              "on the night before a big race", "who receives an old letter", "who plants a tree")
SCENES = ("a farmers' market on a Saturday", "a quiet library at closing time", "a beach at sunrise",
          "a kitchen before a holiday dinner", "a city park after the rain", "a mountain cabin in winter",
          "a harbour at dusk", "a busy airport gate", "a school playground at lunchtime", "a night market",
          "an old bookshop", "a football stadium before a match", "a bakery at five in the morning",
          "a forest path in autumn", "a hospital corridor at night", "a small island village",
          "a science fair", "a crowded bus in the rain", "a desert at night", "a garden in early spring")
ACTIVITIES = ("cycling", "swimming", "reading every day", "learning to cook", "keeping a garden",
              "drinking enough water", "getting enough sleep", "volunteering", "learning a second language",
              "playing chess", "yoga", "writing a journal", "spending time outdoors", "taking short breaks at work",
              "eating more vegetables", "learning to play the piano", "dancing", "hiking", "meditation",
              "playing team sports")
LETTERS = ("thanking a teacher for a good year", "inviting friends to a birthday picnic",
           "asking a landlord to repair a heater", "congratulating a friend on a new job",
           "applying for a summer job at a bookshop", "apologising for missing a meeting",
           "welcoming a new colleague to the team", "thanking a grandmother for a present",
           "complaining politely about a late delivery", "asking a library to stay open longer",
           "recommending a student for a scholarship", "telling a pen pal about your town")
PROSE_FORMS = (
    "Tell me about {subject}.", "Tell me about {subject} in a few paragraphs.", "Write a short essay about {subject}.",
    "Write a blog post about {subject}.", "Write a few paragraphs about {subject}.",
    "Give me an overview of {subject}.", "Why is {subject} interesting? Explain in a few paragraphs.",
    "Explain how {process}.", "Explain how {process}, for {audience}.", "How does it work when {process}?",
    "Write a short story about {character} {situation}.", "Tell a story about {character} {situation}.",
    "Describe {scene}.", "Describe what {scene} looks and sounds like.", "Write a paragraph describing {scene}.",
    "What are the benefits of {activity}?", "What are the benefits of {activity}? Write a few paragraphs.",
    "Give some advice to someone who wants to start {activity}.", "Write a letter {letter}.",
    "Write an email {letter}.", "Write a short speech about {subject}.", "Write a diary entry about {scene}.",
    "Write a poem about {subject}.", "Explain {subject} to {audience}.",
)

JSON_THINGS = {
    "a library book loan": "book_title, member_id, due_date and renewed (a boolean)",
    "a recipe": "name, servings, ingredients (a list) and steps (a list)",
    "a concert ticket": "artist, venue, date, seat and price",
    "a bank transaction": "id, amount, currency, timestamp and category",
    "a pet": "name, species, age and vaccinated (a boolean)",
    "a car rental": "car_model, pickup_date, return_date and insurance (a boolean)",
    "a museum exhibit": "title, artist, year and room",
    "a laptop": "brand, cpu, ram_gb, storage_gb and price_usd",
    "a football match": "home_team, away_team, score and date",
    "a job posting": "title, company, location, salary_range and remote (a boolean)",
    "a restaurant": "name, cuisine, rating and open_hours (an object)",
    "a train timetable entry": "line, departure, arrival and platform",
    "a user profile": "username, email, joined and preferences (an object)",
    "a shopping cart": "items (a list with name, quantity and price) and total",
    "a movie": "title, director, year, genres (a list) and rating",
    "a book": "title, author, year, isbn and tags (a list)",
    "a hospital appointment": "patient, doctor, date, time and department",
    "a parcel delivery": "tracking_number, sender, recipient, status and weight_kg",
    "a university course": "code, title, credits, teacher and prerequisites (a list)",
    "a garden plant": "name, sunlight, water_per_week and height_cm",
    "an invoice": "number, customer, lines (a list), tax and total",
    "a conference talk": "title, speaker, room, start and duration_minutes",
    "a bus route": "number, stops (a list) and first_departure",
    "a city": "name, country, population and landmarks (a list)",
    "a planet": "name, moons, diameter_km and has_rings (a boolean)",
    "a video game": "title, platforms (a list), release_year and multiplayer (a boolean)",
    "an employee": "id, name, department, manager and start_date",
    "a sensor reading": "sensor_id, timestamp, value, unit and ok (a boolean)",
    "a to-do item": "id, title, done (a boolean), due and tags (a list)",
    "a bicycle": "brand, frame_size, gears and price",
    "a podcast episode": "title, host, duration_minutes and guests (a list)",
    "a gym membership": "member, plan, monthly_fee and classes (a list)",
}
JSON_PLURALS = ("books", "movies", "cities", "planets", "pets", "recipes", "employees", "products", "countries",
                "rivers", "mountains", "songs", "cars", "students", "museums", "birds")
JSON_PLURAL_FIELDS = ("name and a short description", "name, year and a rating", "name, country and size",
                      "id, name and tags", "name, type and a boolean field")
CONFIGS = {"a database connection": "host, port, user, database and pool_size",
           "a logging setup": "level, format, handlers (a list) and file",
           "a mobile app": "app_name, version, theme and notifications (an object)",
           "a backup job": "source, destination, schedule and keep_days",
           "a machine learning training run": "model, learning_rate, batch_size, epochs and optimizer",
           "a game": "difficulty, volume, resolution and controls (an object)",
           "an email client": "account, smtp_server, imap_server and signature",
           "a home thermostat": "mode, target_c, schedule (a list) and away (a boolean)"}
PEOPLE_NAMES = ("Tom", "Aisha", "Kenji", "Lucia", "Omar", "Greta", "Ravi", "Chloe", "Pavel", "Nadia", "Samuel",
                "Ingrid", "Diego", "Mei", "Yusuf", "Hannah")
JOBS = ("teacher", "engineer", "chef", "pilot", "pharmacist", "carpenter", "journalist", "farmer", "designer",
        "librarian")
PLACES = ("Oslo", "Lyon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Melbourne", "Dublin", "Seville")
LANGUAGE_SETS = ("English", "Spanish and English", "French and Arabic", "Japanese", "German and Polish",
                 "Hindi and English")
JSON_FORMS = ("Produce a JSON object for {a}: {fields}.", "I need JSON for {a} with fields {fields}.",
              "Describe {a} as JSON with {fields}.", "Give a JSON object for {a} with {fields}.",
              "Return only JSON: {a} with {fields}.", "Create a JSON example of {a} ({fields}).")

CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a string is a palindrome", "returns the n-th prime number",
    "merges two sorted lists into one sorted list", "computes the factorial of a number",
    "converts a temperature from Celsius to Fahrenheit", "finds the largest number in a list without max()",
    "returns the second smallest item of a list", "groups a list of words by their first letter",
    "checks whether two strings are anagrams", "rotates a list by k positions", "sums the digits of an integer",
    "converts a Roman numeral to an integer", "converts an integer to binary without bin()",
    "splits a list into chunks of size n", "transposes a matrix given as a list of lists",
    "returns the intersection of two lists", "capitalizes the first letter of every word",
    "computes the mean, median and mode of a list", "finds all pairs in a list that sum to a target",
    "checks whether a year is a leap year", "returns the greatest common divisor of two numbers",
    "generates all permutations of a string", "parses a date string in YYYY-MM-DD format",
    "reads a CSV file and returns a list of dictionaries", "writes a dictionary to a JSON file",
    "removes all vowels from a string", "checks whether brackets in a string are balanced",
    "returns the longest word in a sentence", "computes compound interest",
    "converts a list of tuples into a dictionary", "finds the missing number in a list from 1 to n",
    "sorts a list of dictionaries by a given key", "returns the character that appears first only once",
    "computes the distance between two points", "checks whether a number is a perfect square",
    "implements run-length encoding of a string", "validates a password's strength",
    "returns the running total of a list", "merges two dictionaries, adding values of shared keys",
    "finds the median of two sorted lists", "computes the area of a polygon from its vertices",
    "returns the first n rows of Pascal's triangle", "converts snake_case to camelCase",
    "returns the digits of a number in reverse order", "finds the longest common prefix of a list of strings",
)
CODE_ALGORITHMS = ("bubble sort", "insertion sort", "merge sort", "quicksort", "a breadth-first search on a graph",
                   "a depth-first search on a graph", "Dijkstra's shortest path algorithm", "the sieve of Eratosthenes",
                   "a linked list", "a binary search tree with insert and search", "a queue using two lists",
                   "an LRU cache", "the Caesar cipher", "matrix multiplication", "a min-heap",
                   "the Euclidean algorithm", "a trie for word lookup", "topological sorting")
CODE_CLASSES = {"a bank account": "deposit, withdraw and balance", "a to-do list": "add, remove and list_items",
                "a shopping cart": "add_item, remove_item and total", "a temperature sensor": "read, average and reset",
                "a library": "add_book, borrow and return_book", "a rectangle": "area, perimeter and scale",
                "a timer": "start, stop and elapsed", "a queue": "enqueue, dequeue and size",
                "a matrix": "add, multiply and transpose", "a student record": "add_grade, average and report",
                "an inventory": "add, remove and low_stock", "a playlist": "add_song, shuffle and next_song"}
CODE_SCRIPTS = ("renames all .txt files in a folder to lower case", "prints the size of every file in a folder",
                "downloads nothing but parses a local HTML file and prints its links",
                "reads numbers from a file and prints their average", "prints a multiplication table",
                "asks the user for a number and tells whether it is prime",
                "prints the current date and time in three formats", "finds the longest line in a text file",
                "merges several CSV files into one", "prints the calendar of the current month",
                "copies a folder and logs every file it copies", "counts the lines of code in Python files")
CODE_FORMS = ("Write a Python function that {task}.", "Write a Python function that {task}, with a docstring.",
              "Write a Python function that {task}, and show an example call.", "Implement {algorithm} in Python.",
              "Write {algorithm} in Python with comments.", "Write a Python class for {thing} with {methods} methods.",
              "Write a Python script that {script}.", "How do I write a Python function that {task}?")

# A second sentence people often add; a request gets one of these half the time.
EXTRAS = {
    "code": ("Use type hints.", "Add a few assert tests.", "Keep it short.", "Explain the code afterwards.",
             "Raise ValueError on invalid input.", "Do not use any imports.", "Make it efficient.",
             "Include a docstring with an example."),
    "json": ("Use realistic values.", "Only output the JSON.", "Use snake_case keys.", "Add an id field too.",
             "Format it nicely.", "Include one nested object."),
    "prose": ("Keep it under 200 words.", "Use simple words.", "Make it warm and friendly.", "Use three paragraphs.",
              "End with a short summary.", "Write it in the first person.", "Make it funny.",
              "Give two examples."),
}


def names_benchmark_subject(text: str) -> bool:
    """Whether ``text`` names a subject of a held-out benchmark request (a whole-word, case-blind match)."""
    return any(re.search(rf"\b{re.escape(subject)}\b", text, flags=re.IGNORECASE) for subject in BENCHMARK_SUBJECTS)


def _pick(rng: random.Random, values: tuple[str, ...] | list[str]) -> str:
    return rng.choice(values)


def prose_request(rng: random.Random) -> str:
    form = _pick(rng, PROSE_FORMS)
    return form.format(subject=_pick(rng, PROSE_SUBJECTS), process=_pick(rng, PROCESSES),
                       audience=_pick(rng, AUDIENCES), character=_pick(rng, CHARACTERS),
                       situation=_pick(rng, SITUATIONS), scene=_pick(rng, SCENES),
                       activity=_pick(rng, ACTIVITIES), letter=_pick(rng, LETTERS))


def json_request(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        thing = _pick(rng, sorted(JSON_THINGS))
        return _pick(rng, JSON_FORMS).format(a=thing, fields=JSON_THINGS[thing])
    if kind == 1:
        return (f"Output a JSON list of {rng.randint(2, 5)} {_pick(rng, JSON_PLURALS)}, each with "
                f"{_pick(rng, JSON_PLURAL_FIELDS)}.")
    if kind == 2:
        system = _pick(rng, sorted(CONFIGS))
        return f"Create a JSON configuration for {system}: {CONFIGS[system]}."
    name, age = _pick(rng, PEOPLE_NAMES), rng.randint(19, 80)
    return (f"Turn this into JSON: {name}, {age}, {_pick(rng, JOBS)}, lives in {_pick(rng, PLACES)}, speaks "
            f"{_pick(rng, LANGUAGE_SETS)}.")


def code_request(rng: random.Random) -> str:
    thing = _pick(rng, sorted(CODE_CLASSES))
    return _pick(rng, CODE_FORMS).format(task=_pick(rng, CODE_TASKS), algorithm=_pick(rng, CODE_ALGORITHMS),
                                         thing=thing, methods=CODE_CLASSES[thing], script=_pick(rng, CODE_SCRIPTS))


OPEN_MAKERS = {"code": code_request, "json": json_request, "prose": prose_request}


def open_requests(rng: random.Random, n: int) -> Iterator[Request]:
    """``n`` open-ended chat requests, the three domains in turn (repeats are dropped by the caller)."""
    domains = sorted(OPEN_MAKERS)
    for i in range(n):
        domain = domains[i % len(domains)]
        text = OPEN_MAKERS[domain](rng)
        if rng.random() < 0.5:
            text = f"{text} {_pick(rng, EXTRAS[domain])}"
        yield {"domain": domain, "kind": "open", "messages": [{"role": "user", "content": text}]}


# Stage 7: more code asks. Stage 6's code slots make only ~1,100 distinct asks (465 new in a second set), and code
# was the domain stage 6 moved most (the head's code alpha 0.44 -> 0.53). Separate lists and their own kind
# (``open_code``), so the slot lists above, and every earlier set's ids, stay as they were.
CODE_TASKS_MORE = (
    "counts how many times each character appears in a string", "returns the n largest items of a list",
    "removes punctuation from a string", "checks whether a list is sorted", "interleaves two lists",
    "finds the index of the smallest item of a list", "converts a number of seconds to hours, minutes and seconds",
    "returns all the divisors of a number", "checks whether a number is an Armstrong number",
    "computes the power set of a list", "converts a hexadecimal string to an integer",
    "returns the words of a sentence sorted by length", "computes a moving average over a window of size k",
    "returns the cumulative product of a list", "pads a string to a given width with a fill character",
    "finds the longest increasing subsequence of a list", "counts the vowels and consonants in a string",
    "checks whether a string is a valid IPv4 address", "normalises the whitespace in a string",
    "returns the keys of a dictionary sorted by their values", "inverts a dictionary",
    "computes the dot product of two vectors", "generates a random password of a given length",
    "computes the Levenshtein distance between two strings", "finds the mode of a list of numbers",
    "truncates a string to n characters and adds an ellipsis", "converts a list of strings to integers, skipping "
    "the invalid ones", "returns the prime factors of a number", "checks whether a matrix is symmetric",
    "computes the nth triangular number", "returns the union of several sets", "clamps a number to a range",
    "counts the lines, words and characters of a text", "zips two lists into a dictionary",
    "converts a string to title case without title()", "computes the average of the values in a dictionary",
    "finds the common elements of three lists", "returns the indexes of every occurrence of a value in a list",
    "converts kilometres to miles", "computes the body mass index from weight and height",
    "checks whether a sentence is a pangram", "returns the sum of the even numbers in a list",
    "encodes a string in base64", "returns the last n lines of a file", "swaps the keys and values of a dictionary",
    "computes the area and circumference of a circle", "returns a list without its None values",
    "finds the peak element of a list", "converts a list of words to a sentence with commas and 'and'",
    "checks whether two rectangles overlap", "rounds a number to the nearest multiple of 5",
    "computes simple statistics of a list of grades", "returns the number of days between two dates",
    "replaces every digit in a string with '#'", "checks whether a number is a power of two",
    "builds a histogram of a list of numbers as text", "returns the k most frequent items of a list",
)
PYTHON_CONCEPTS = ("list comprehensions", "decorators", "generators", "context managers", "dataclasses",
                   "f-strings", "lambda functions", "*args and **kwargs", "exceptions and try/except",
                   "the with statement", "dictionaries", "sets", "slicing", "enumerate", "zip", "map and filter",
                   "classes and inheritance", "modules and imports", "type hints", "recursion", "iterators",
                   "string methods", "reading and writing files", "sorting with a key function",
                   "default arguments", "unit tests with unittest", "the collections module", "itertools",
                   "regular expressions", "pathlib", "argparse", "the logging module", "the json module",
                   "the datetime module", "the random module", "async and await", "properties",
                   "static methods and class methods", "tuples", "while loops", "for loops", "the walrus operator",
                   "pattern matching with match/case", "virtual environments", "list sorting", "global variables")
CODE_FORMS_MORE = ("Can you write a Python function that {task}?", "Write a function in Python which {task}.",
                   "Please write Python code that {task}.", "I need a Python function that {task}.",
                   "Write a short Python program that {task} and prints the result.",
                   "Give me a Python one-liner or a short function that {task}.",
                   "Explain {concept} in Python with an example.", "How do {concept} work in Python?",
                   "Show me how to use {concept} in Python.", "Write a Python example that uses {concept}.",
                   "What are {concept} in Python? Give a short code example.")
CODE_EXTRAS_MORE = ("Add comments.", "Use a for loop.", "Handle an empty input.", "Print an example.",
                    "Write it as simply as possible.", "Follow PEP 8.", "Add type hints and a docstring.",
                    "Show the output too.")


def code_request_more(rng: random.Random) -> str:
    """A code ask from stage 7's slot lists (tasks, Python concepts, forms)."""
    return _pick(rng, CODE_FORMS_MORE).format(task=_pick(rng, CODE_TASKS_MORE), concept=_pick(rng, PYTHON_CONCEPTS))


def open_code_requests(rng: random.Random, n: int) -> Iterator[Request]:
    """``n`` open-ended Python asks from stage 7's slot lists (repeats are dropped by the caller)."""
    for _ in range(n):
        text = code_request_more(rng)
        if rng.random() < 0.5:
            text = f"{text} {_pick(rng, CODE_EXTRAS_MORE + EXTRAS['code'])}"
        yield {"domain": "code", "kind": "open_code", "messages": [{"role": "user", "content": text}]}
