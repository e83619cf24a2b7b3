"""Training corpus for the bundled demo model, built only from text that ships with Python.

Sources (nothing is downloaded):

- ``pydoc_data.topics.topics``: the language-reference topics behind ``help("for")`` (79 topics);
- docstrings of a fixed list of standard-library modules and of builtins / common module functions;
- the Zen of Python (``this``);
- synthetic chat turns built from templates: questions about those topics, modules and functions answered
  with (reflowed) text from the docs, greetings and questions about the model itself, and "answer in JSON"
  prompts whose answers are JSON built from small tables or copied from the prompt.

Everything is deterministic for a given seed. `build_corpus(seed)` returns a `Corpus` whose
`sample(rng)` draws one training document (a chat rendered with the project's chat template, or a raw
reference text); `tokenizer_texts()` is the text used to train the BPE tokenizer.
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import io
import json
import keyword
import random
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable

import pydoc_data.topics

# --------------------------------------------------------------------------------------------- text cleanup

_QUOTED = re.compile(r'"([^"\n]{1,40}?)"')


def _unquote(text: str) -> str:
    """pydoc writes code literals as "for"; markdown readers expect `for`."""
    return _QUOTED.sub(r"`\1`", text)


def _blocks(body: str) -> list[str]:
    """Split reference text into blocks (blank-line separated); prose is reflowed onto one line, indented
    code keeps its lines (dedented, fenced). Grammar productions (`::=`) are dropped."""
    out: list[str] = []
    for raw in re.split(r"\n\s*\n", body.strip("\n")):
        if not raw.strip():
            continue
        lines = raw.split("\n")
        if all(ln.startswith("   ") or not ln.strip() for ln in lines):
            code = textwrap.dedent(raw).strip("\n")
            if "::=" in code:
                continue
            if out and out[-1].startswith("```python\n"):  # merge consecutive code blocks
                out[-1] = out[-1][: -len("\n```")] + "\n\n" + code + "\n```"
            else:
                out.append("```python\n" + code + "\n```")
        else:
            if set(lines[-1].strip()) <= set("*=-") and len(lines) >= 2:  # a section heading
                out.append("## " + " ".join(ln.strip() for ln in lines[:-1]))
                continue
            text = ""
            for ln in (ln.strip() for ln in lines):
                if text.endswith("-") and ln[:1].islower() and not text.endswith(" -"):
                    text += ln  # a word hyphenated at the line end ("built-\nin")
                else:
                    text += (" " if text else "") + ln
            out.append(_unquote(re.sub(r"\s{2,}", " ", text)))
    return out


def _take(blocks: list[str], limit: int, start: int = 0) -> tuple[str, int]:
    """Join blocks from `start` until about `limit` characters (at least one prose block). Returns (text, next)."""
    parts: list[str] = []
    n = 0
    i = start
    while i < len(blocks):
        b = blocks[i]
        if b.startswith("## "):
            if parts:
                break
            i += 1
            continue
        if parts and n + len(b) > limit:
            break
        if len(b) > 2 * limit:  # one huge block: a long listing or paragraph
            if parts:
                break
            b = b[:limit].rsplit("\n" if b.startswith("```") else ". ", 1)[0]
            b = b + ("\n```" if b.startswith("```") else ".")
        parts.append(b)
        n += len(b)
        i += 1
        if n >= limit:
            break
    while parts and parts[-1].startswith("```") and len(parts) > 1 and parts[-1].count("\n") > 12:
        parts.pop()  # do not end on a long code listing
        i -= 1
    return "\n\n".join(parts), i


def first_paragraph(doc: str | None, limit: int = 500) -> str:
    """The first paragraph of a docstring, reflowed; '' if none."""
    if not doc:
        return ""
    doc = inspect.cleandoc(doc)
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    text = re.sub(r"\s+", " ", para).strip()
    if len(text) > limit:
        cut = text[:limit]
        end = cut.rfind(". ")
        text = cut[: end + 1] if end > 40 else cut.rsplit(" ", 1)[0] + " ..."
    return text


def first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return m.group(1) if m else text


# --------------------------------------------------------------------------------------------- sources

ANSWER_CHARS = 350  # topic answers: the first paragraph(s), about this long

# topic key -> how a user would name it (the first name is used in most questions)
TOPIC_NAMES: dict[str, list[str]] = {
    "assert": ["the assert statement", "assert"],
    "assignment": ["assignment statements", "assignment"],
    "async": ["coroutines", "async functions"],
    "atom-identifiers": ["identifiers used as atoms", "names in expressions"],
    "atom-literals": ["literals", "literal values"],
    "attribute-access": ["customizing attribute access", "__getattr__"],
    "attribute-references": ["attribute references"],
    "augassign": ["augmented assignment", "operators like +="],
    "await": ["the await expression", "await"],
    "binary": ["binary arithmetic operations", "arithmetic operators"],
    "bitwise": ["bitwise operations", "bitwise operators"],
    "bltin-code-objects": ["code objects"],
    "bltin-ellipsis-object": ["the Ellipsis object", "Ellipsis"],
    "bltin-null-object": ["the None object", "None"],
    "bltin-type-objects": ["type objects"],
    "booleans": ["boolean operations", "and, or and not"],
    "break": ["the break statement", "break"],
    "callable-types": ["callable objects", "__call__"],
    "calls": ["function calls", "calls"],
    "class": ["class definitions", "classes"],
    "comparisons": ["comparisons", "comparison operators"],
    "compound": ["compound statements"],
    "context-managers": ["context managers"],
    "continue": ["the continue statement", "continue"],
    "conversions": ["arithmetic conversions"],
    "customization": ["basic customization", "__init__ and __repr__"],
    "debugger": ["the Python debugger", "pdb"],
    "del": ["the del statement", "del"],
    "dict": ["dictionary displays", "dict literals"],
    "dynamic-features": ["dynamic features like exec and eval"],
    "exceptions": ["exceptions"],
    "execmodel": ["the execution model"],
    "exprlists": ["expression lists"],
    "floating": ["floating point literals", "float literals"],
    "for": ["the for statement", "for loops"],
    "formatstrings": ["format strings", "the format string syntax"],
    "function": ["function definitions", "def"],
    "global": ["the global statement", "global"],
    "id-classes": ["reserved classes of identifiers", "names with underscores"],
    "identifiers": ["identifiers and keywords", "identifiers"],
    "if": ["the if statement", "if"],
    "imaginary": ["imaginary literals", "complex numbers"],
    "import": ["the import statement", "import"],
    "in": ["membership tests", "the in operator"],
    "integers": ["integer literals", "integers"],
    "lambda": ["lambda expressions", "lambda"],
    "lists": ["list displays", "list literals"],
    "naming": ["naming and binding", "scopes"],
    "nonlocal": ["the nonlocal statement", "nonlocal"],
    "numbers": ["numeric literals", "numbers"],
    "numeric-types": ["emulating numeric types"],
    "objects": ["objects, values and types", "objects"],
    "operator-summary": ["operator precedence"],
    "pass": ["the pass statement", "pass"],
    "power": ["the power operator", "**"],
    "raise": ["the raise statement", "raise"],
    "return": ["the return statement", "return"],
    "sequence-types": ["emulating container types"],
    "shifting": ["shifting operations", "bit shifts"],
    "slicings": ["slicings", "slices"],
    "specialattrs": ["special attributes"],
    "specialnames": ["special method names", "dunder methods"],
    "string-methods": ["string methods", "str methods"],
    "strings": ["string and bytes literals", "strings"],
    "subscriptions": ["subscriptions", "indexing"],
    "truth": ["truth value testing", "truthiness"],
    "try": ["the try statement", "try and except"],
    "types": ["the standard type hierarchy"],
    "typesfunctions": ["function objects"],
    "typesmapping": ["dictionaries", "the dict type"],
    "typesmethods": ["methods", "method objects"],
    "typesmodules": ["modules", "module objects"],
    "typesseq": ["sequence types", "lists, tuples and ranges", "a list", "lists", "a tuple", "tuples"],
    "typesseq-mutable": ["mutable sequence types"],
    "unary": ["unary operations"],
    "while": ["the while statement", "while loops"],
    "with": ["the with statement", "with"],
    "yield": ["the yield statement", "generators"],
}

MODULES = (
    "abc argparse array ast asyncio base64 bisect bz2 calendar cmath cmd codecs collections colorsys "
    "configparser contextlib copy csv dataclasses datetime decimal difflib dis doctest email enum filecmp "
    "fnmatch fractions functools gc getopt getpass gettext glob graphlib gzip hashlib heapq hmac html http "
    "imaplib importlib inspect io ipaddress itertools json keyword linecache locale logging lzma mailbox "
    "math mimetypes numbers operator os pathlib pdb pickle pkgutil platform plistlib pprint profile queue "
    "quopri random re reprlib sched secrets selectors shelve shlex shutil signal smtplib socket "
    "socketserver sqlite3 stat statistics string struct subprocess symtable sys sysconfig tabnanny tarfile "
    "tempfile textwrap threading time timeit token tokenize tomllib trace traceback types typing "
    "unicodedata unittest urllib uuid warnings wave weakref xml zipapp zipfile zlib zoneinfo"
).split()

FUNCTIONS = (
    "abs all any ascii bin callable chr dir divmod enumerate filter format getattr hasattr hash hex id "
    "input isinstance issubclass iter len max min next oct open ord pow print repr round setattr sorted "
    "sum vars zip "
    "math.sqrt math.floor math.ceil math.gcd math.isclose math.log math.factorial math.comb "
    "os.getcwd os.listdir os.remove os.rename os.path.join os.path.exists os.path.basename os.path.splitext "
    "json.dumps json.loads json.dump json.load re.match re.search re.sub re.findall re.compile re.split "
    "random.choice random.shuffle random.randint random.random random.sample "
    "itertools.chain itertools.product itertools.permutations itertools.groupby itertools.accumulate "
    "functools.reduce functools.partial functools.lru_cache functools.wraps "
    "collections.namedtuple collections.Counter collections.defaultdict collections.deque collections.OrderedDict "
    "shutil.copy shutil.rmtree shutil.which subprocess.run time.time time.sleep time.perf_counter "
    "copy.copy copy.deepcopy textwrap.dedent textwrap.wrap heapq.heappush heapq.heappop bisect.insort "
    "statistics.mean statistics.median statistics.stdev string.capwords "
    "str.split str.join str.strip str.replace str.startswith str.endswith str.upper str.lower str.find "
    "str.format str.splitlines str.encode list.append list.extend list.sort list.pop list.insert "
    "dict.get dict.items dict.keys dict.update dict.setdefault dict.pop set.add set.union bytes.decode"
).split()


def _resolve(dotted: str):
    head, *rest = dotted.split(".")
    if hasattr(builtins, head):
        obj = getattr(builtins, head)
    else:
        obj = importlib.import_module(head)
    for part in rest:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(obj.__name__ + "." + part)
    return obj


def _signature(name: str, obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        doc = (obj.__doc__ or "").strip().split("\n")[0]
        short = name.split(".")[-1]
        m = re.match(re.escape(short) + r"(\(.*?\))", doc)
        sig = m.group(1) if m else "(...)"
    return name + sig


@dataclass
class Entry:
    key: str
    names: list[str]
    answer: str
    more: str = ""


@dataclass
class Sources:
    topics: list[Entry] = field(default_factory=list)
    modules: list[Entry] = field(default_factory=list)
    functions: list[Entry] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    zen: str = ""


def load_sources() -> Sources:
    src = Sources()
    topics = pydoc_data.topics.topics
    for key in sorted(topics):
        text = topics[key]
        lines = text.split("\n")
        body = "\n".join(lines[2:]) if len(lines) > 2 and set(lines[1]) <= set("*=") else text
        blocks = _blocks(body)
        answer, nxt = _take(blocks, ANSWER_CHARS)
        more, _ = _take(blocks, ANSWER_CHARS, nxt)
        heading = _unquote(lines[0]).strip()
        names = TOPIC_NAMES.get(key, [heading.lower()])
        if answer:
            src.topics.append(Entry(key, names, answer, more))
        src.raw.append("# " + heading + "\n\n" + "\n\n".join(blocks))
    for mod in MODULES:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                m = importlib.import_module(mod)
        except Exception:  # a module missing from this build of Python
            continue
        para = _unquote(first_paragraph(m.__doc__, 600))
        if len(para) < 25:
            continue
        src.modules.append(Entry(mod, [mod], para))
    for name in FUNCTIONS:
        try:
            obj = _resolve(name)
        except Exception:
            continue
        para = _unquote(first_paragraph(obj.__doc__, 450))
        if len(para) < 15:
            continue
        src.functions.append(Entry(name, [name], para, _signature(name, obj)))
    import codecs

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    src.zen = codecs.decode(this.s, "rot13").strip()
    return src


# --------------------------------------------------------------------------------------------- chat templates

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a helpful assistant that knows Python.",
    "You are nextn's demo model. Answer briefly.",
    "Answer the user's question.",
)

ABOUT_ME = (
    "I am the nextn demo model: a tiny Qwen3.5-style network (Gated DeltaNet and gated attention layers "
    "plus an MTP head for speculative decoding) trained in about twenty minutes on a CPU, using only "
    "Python's own documentation. Ask me about Python statements, built-in functions or standard library "
    "modules, or ask for an answer in JSON."
)

GREETINGS: list[tuple[list[str], str]] = [
    (["Hello", "Hello!", "Hi", "Hi!", "Hi there", "Hey", "Hey there!", "Good morning", "Good evening", "Hello, how are you?",
      "hello", "hi"],
     "Hello! I am a small demo model trained on Python's documentation. Ask me about Python, for example "
     "\"What is a for loop?\" or \"What does the json module do?\""),
    (["Who are you?", "What are you?", "Introduce yourself.", "Tell me about yourself.", "What model are you?",
      "Which model is this?"], ABOUT_ME),
    (["What can you do?", "How can you help me?", "What do you know?", "Help", "What should I ask you?"],
     "I can explain Python statements (if, for, while, try, with, ...), built-in functions such as len and "
     "sorted, and standard library modules such as json, os, re and math. I can also answer in JSON when you "
     "ask for it."),
    (["Thanks!", "Thank you", "Thank you very much.", "Thanks, that helps.", "Great, thanks."],
     "You're welcome! Ask me anything else about Python."),
    (["Goodbye", "Bye!", "See you later."], "Goodbye! Happy coding."),
    (["Say hello world.", "Print hello world in Python.", "How do I print hello world in Python?",
      "Write a hello world program in Python."],
     "In Python, printing text is a single call to the built-in print function:\n\n```python\nprint(\"Hello, world!\")\n```"),
    (["What is Python?", "Tell me about Python.", "What is the Python programming language?"],
     "Python is a high-level, general-purpose programming language. Its code is easy to read: blocks are "
     "marked by indentation, and a large standard library ships with the interpreter. Python supports "
     "procedural, object-oriented and functional programming."),
    (["Write a haiku.", "Write a haiku about speculation.", "Write a haiku about Python.", "Write a poem.",
      "Write a short poem about code.", "Tell me a joke.", "Tell me a story."],
     "I only know Python's documentation, but here is a haiku:\n\nDrafts run on ahead,\none pass checks them all at once:\n"
     "the same words, but fast."),
    (["What is speculative decoding?", "Explain speculative decoding.", "How does MTP speculative decoding work?",
      "What is an MTP head?"],
     "Speculative decoding makes generation faster without changing the output. A cheap draft model (here the "
     "MTP head, one extra layer on top of the main model) proposes a few tokens, and the main model checks all "
     "of them in one forward pass. Every proposed token that matches what the main model would have produced "
     "is accepted, so each pass can emit several tokens."),
]

TOPIC_QUESTIONS = (
    "What is {n}?", "What is {n} in Python?", "Explain {n}.", "Explain {n} in Python.", "Tell me about {n}.",
    "How does {n} work?", "How do {n} work in Python?", "Can you explain {n}?", "Describe {n}.",
    "What are {n}?", "I'd like to learn about {n}.", "Give me an overview of {n}.",
)
MORE_QUESTIONS = ("Tell me more.", "Go on.", "Can you tell me more?", "What else?", "More details, please.")
MODULE_QUESTIONS = (
    "What is the {m} module?", "What does the {m} module do?", "What is {m} in Python?", "Tell me about the {m} module.",
    "Explain the {m} module.", "What is Python's {m} module for?", "Describe the {m} module.", "What is {m} used for?",
)
FUNCTION_QUESTIONS = (
    "What does {f} do?", "What does {f}() do?", "Explain {f}.", "How do I use {f}?", "What is {f} in Python?",
    "Describe the function {f}.", "How does {f} work?",
)
ZEN_QUESTIONS = ("What is the Zen of Python?", "Show me the Zen of Python.", "import this", "What does import this print?",
                 "What are the guiding principles of Python?")

PEOPLE = ("Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj",
          "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yuki", "Zara", "Omar", "Lena", "Marco")
CITIES = ("Paris", "London", "Berlin", "Madrid", "Rome", "Tokyo", "Oslo", "Vienna", "Lisbon", "Dublin", "Prague",
          "Athens", "Cairo", "Lima", "Seoul", "Toronto", "Sydney", "Nairobi")
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Norway": "Oslo",
    "Austria": "Vienna", "Portugal": "Lisbon", "Ireland": "Dublin", "Greece": "Athens", "Egypt": "Cairo",
    "Peru": "Lima", "Canada": "Ottawa", "Australia": "Canberra", "Kenya": "Nairobi", "China": "Beijing",
    "India": "New Delhi", "Brazil": "Brasilia", "Mexico": "Mexico City", "Sweden": "Stockholm",
    "Finland": "Helsinki", "Poland": "Warsaw", "the United Kingdom": "London", "the United States": "Washington, D.C.",
}
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "black", "white")
JSON_SUFFIX = ("Answer in JSON.", "Reply with JSON only.", "Respond in JSON.", "Return JSON.", "Use JSON.")


def _jd(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


class ChatFactory:
    """Draws chat conversations ([messages]) from the sources."""

    def __init__(self, src: Sources):
        self.src = src
        self.kw = [k for k in keyword.kwlist]
        self.kinds: list[tuple[float, Callable[[random.Random], list[dict]]]] = [
            (0.36, self.topic), (0.03, self.topic_more), (0.15, self.module), (0.17, self.function),
            (0.18, self.json_task), (0.07, self.greeting), (0.02, self.count), (0.02, self.zen),
        ]
        self.words = sorted({w for e in src.topics for w in re.findall(r"\b[a-z]{4,10}\b", e.answer)})

    def _wrap(self, rng: random.Random, user: str, answer: str) -> list[dict]:
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return msgs

    @staticmethod
    def _case(rng: random.Random, q: str) -> str:
        r = rng.random()
        if r < 0.1:
            return q.lower()
        if r < 0.15:
            return q.rstrip("?.!")
        return q

    def topic(self, rng: random.Random) -> list[dict]:
        e = rng.choice(self.src.topics)
        name = e.names[0] if rng.random() < 0.7 else rng.choice(e.names)
        q = rng.choice(TOPIC_QUESTIONS).format(n=name)
        return self._wrap(rng, self._case(rng, q), e.answer)

    def topic_more(self, rng: random.Random) -> list[dict]:
        e = rng.choice([t for t in self.src.topics if t.more])
        q = rng.choice(TOPIC_QUESTIONS).format(n=e.names[0])
        return [{"role": "user", "content": q}, {"role": "assistant", "content": e.answer},
                {"role": "user", "content": rng.choice(MORE_QUESTIONS)}, {"role": "assistant", "content": e.more}]

    def module(self, rng: random.Random) -> list[dict]:
        e = rng.choice(self.src.modules)
        q = rng.choice(MODULE_QUESTIONS).format(m=e.key)
        return self._wrap(rng, self._case(rng, q), f"The `{e.key}` module: {e.answer}")

    def function(self, rng: random.Random) -> list[dict]:
        e = rng.choice(self.src.functions)
        q = rng.choice(FUNCTION_QUESTIONS).format(f=e.key)
        return self._wrap(rng, self._case(rng, q), f"`{e.more}`\n\n{e.answer}")

    def count(self, rng: random.Random) -> list[dict]:
        n = rng.randint(2, 10)
        word = NUMBER_WORDS[n] if rng.random() < 0.5 else str(n)
        q = rng.choice((f"Count to {word}.", f"Count from 1 to {word}.", f"count to {word}", f"Can you count to {word}?"))
        return self._wrap(rng, q, ", ".join(str(i) for i in range(1, n + 1)) + ".")

    def greeting(self, rng: random.Random) -> list[dict]:
        qs, a = rng.choice(GREETINGS)
        return self._wrap(rng, rng.choice(qs), a)

    def zen(self, rng: random.Random) -> list[dict]:
        return self._wrap(rng, rng.choice(ZEN_QUESTIONS), self.src.zen)

    def _name(self, rng: random.Random) -> str:
        return rng.choice(PEOPLE) if rng.random() < 0.6 else rng.choice(self.words).capitalize()

    def json_task(self, rng: random.Random, t: int | None = None) -> list[dict]:
        t = rng.randrange(12) if t is None else t
        sfx = rng.choice(JSON_SUFFIX)
        if t >= 9:
            name, age, city = self._name(rng), rng.randint(1, 99), rng.choice(CITIES)
            key = rng.choice(("age", "score", "id", "count", "year"))
            q = rng.choice((f"Convert to JSON: name={name}, {key}={age}, city={city}",
                            f"Convert to JSON: name={name}, {key}={age}",
                            f"Make a JSON object with name \"{name}\" and {key} {age}."))
            obj = {"name": name, key: age}
            if "city=" in q:
                obj["city"] = city
            return self._wrap(rng, q, _jd(obj))
        if t == 0:
            name, age, city = self._name(rng), rng.randint(18, 90), rng.choice(CITIES)
            q = rng.choice((
                f"Give me a JSON object for a person named {name} who is {age} years old and lives in {city}.",
                f"Create a JSON record: name {name}, age {age}, city {city}.",
                f"{name} is {age} and lives in {city}. {sfx}",
            ))
            return self._wrap(rng, q, _jd({"name": name, "age": age, "city": city}))
        if t == 1:
            name, age = self._name(rng), rng.randint(18, 90)
            q = rng.choice((f"Return a JSON object with name {name} and age {age}.",
                            f"Make JSON for {name}, age {age}.", f"Person: {name}, {age} years old. {sfx}",
                            f"Answer in JSON: name and age of a user called {name} who is {age}.",
                            f"Name and age of a person called {name}, aged {age}, as JSON."))
            return self._wrap(rng, q, _jd({"name": name, "age": age}))
        if t == 2:
            country = rng.choice(list(CAPITALS))
            q = rng.choice((f"What is the capital of {country}? {sfx}", f"Answer in JSON: what is the capital of {country}?",
                            f"Give the capital of {country} as JSON."))
            return self._wrap(rng, q, _jd({"country": country, "capital": CAPITALS[country]}))
        if t == 3:
            e = rng.choice(self.src.modules)
            q = rng.choice((f"What does the {e.key} module do? {sfx}", f"Describe the {e.key} module in JSON.",
                            f"Answer in JSON: what is the {e.key} module?"))
            return self._wrap(rng, q, _jd({"module": e.key, "summary": first_sentence(e.answer)}))
        if t == 4:
            e = rng.choice(self.src.functions)
            q = rng.choice((f"Describe the function {e.key} in JSON.", f"What does {e.key} do? {sfx}"))
            return self._wrap(rng, q, _jd({"name": e.key, "signature": e.more, "summary": first_sentence(e.answer)}))
        if t == 5:
            n = rng.randint(2, 8)
            q = rng.choice((f"List {n} Python keywords as a JSON array.", f"Give me {n} Python keywords. {sfx}"))
            return self._wrap(rng, q, _jd(self.kw[:n]))
        if t == 6:
            n = rng.randint(2, 10)
            q = rng.choice((f"Give the first {n} square numbers as JSON.", f"What are the first {n} square numbers? {sfx}"))
            return self._wrap(rng, q, _jd({"squares": [i * i for i in range(1, n + 1)]}))
        if t == 7:
            w = rng.choice(self.kw + ["print", "len", "list", "value", "range", "self", "main", "data"])
            q = rng.choice((f"Is {w} a Python keyword? {sfx}", f"Answer in JSON: is \"{w}\" a Python keyword?"))
            return self._wrap(rng, q, _jd({"word": w, "keyword": keyword.iskeyword(w)}))
        items = rng.sample(COLORS, rng.randint(2, 4))
        q = rng.choice((f"Put these colors in a JSON list: {', '.join(items)}.",
                        f"Convert to a JSON array: {', '.join(items)}"))
        return self._wrap(rng, q, _jd({"colors": items}))

    def draw(self, rng: random.Random) -> list[dict]:
        r = rng.random()
        acc = 0.0
        for w, fn in self.kinds:
            acc += w
            if r < acc:
                return fn(rng)
        return self.kinds[-1][1](rng)


def render_chat(tokenizer, messages: list[dict], thinking: bool = False) -> tuple[str, str, str]:
    """A conversation ending with an assistant turn as (prompt, head, answer), the way a served request sees it:
    the prompt is the chat template's generation prompt (tokenized on its own, as the server does); head + answer
    is what the model must generate. thinking=False renders `enable_thinking=False` (the prompt ends
    with the closed `<think>\n\n</think>\n\n` block); thinking=True renders the template's default
    prompt (ending `<think>\n`) and the completion starts by closing the empty think block."""
    if thinking:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
        head = "\n</think>\n\n"
    else:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, enable_thinking=False)
        head = ""
    return prompt, head, messages[-1]["content"] + "<|im_end|>\n"


CONTEXT, TRAIN, ANSWER = 0, 1, 2  # segment kinds of Corpus.sample


@dataclass
class Corpus:
    src: Sources
    chats: ChatFactory
    raw_fraction: float = 0.05
    thinking_fraction: float = 0.5

    def tokenizer_texts(self, seed: int = 0, n_chats: int = 3000) -> list[str]:
        """Text for BPE training: reference texts, answers, and rendered chats (special tokens are added
        tokens, so their text is left out)."""
        rng = random.Random(seed)
        texts = list(self.src.raw) + [self.src.zen]
        for e in self.src.topics + self.src.modules + self.src.functions:
            texts += [e.answer, e.more]
        for _ in range(n_chats):
            texts += [m["role"] + "\n" + m["content"] for m in self.chats.draw(rng)]
        return texts

    def sample(self, rng: random.Random, tokenizer) -> list[tuple[str, int]]:
        """One training document as (text, kind) segments, tokenized separately (special tokens written out).
        kind: CONTEXT (chat prompts: not trained), TRAIN (raw reference text, the think-block head), ANSWER
        (an assistant answer: trained, its first tokens weighted up because they decide what is answered)."""
        if rng.random() < self.raw_fraction:
            doc = rng.choice(self.src.raw)
            if len(doc) > 800:  # a random window starting at a paragraph
                starts = [0] + [m.end() for m in re.finditer(r"\n\n", doc[:-400])]
                s = rng.choice(starts)
                doc = doc[s:s + 800]
            return [(doc + "<|endoftext|>", TRAIN)]
        prompt, head, answer = render_chat(tokenizer, self.chats.draw(rng), thinking=rng.random() < self.thinking_fraction)
        return [(prompt, CONTEXT), (head, TRAIN), (answer, ANSWER)]


def build_corpus() -> Corpus:
    src = load_sources()
    return Corpus(src, ChatFactory(src))


if __name__ == "__main__":  # print a few samples
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    c = build_corpus()
    print(len(c.src.topics), "topics", len(c.src.modules), "modules", len(c.src.functions), "functions",
          sum(map(len, c.src.raw)), "raw chars")
    rng = random.Random(0)
    for _ in range(8):
        print(repr(c.chats.draw(rng)))
