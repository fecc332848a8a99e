"""Synthetic long-range recall documents: key-value facts stated early, queried after N tokens of filler.

A document states `n_pairs` facts ("The code of the silver fox is 482913.") and later asks for
some of them ("What is the code of the silver fox? It is 482913."), with filler text in between.
The value after "It is " is the answer: a model that remembers the fact predicts its digits; one
that does not can only guess. The distance of a query is counted in tokens, from the last token of
the key's previous mention (its fact, or an earlier answer) to the first token of the answer; a distance shorter than the
query's own text ("What is the code of the silver fox? It is ", ~45 bytes) comes out that long.

Chance level: an answer digit is one of 10, so a model that forgot the fact scores 0.10 per digit
(a byte tokenizer gives one token per digit; other tokenizers report accuracy per answer token,
and its chance level is at most that of guessing the digits).

Filler is drawn per stretch from three kinds, so that no one kind of text can be learned away:
random words in sentences, sentences with random numbers in them (distractor digits), and the
repeated "grass is green" text of the passkey task (Mohtashami & Jaggi 2023). Or it is cut from a
real text (`filler=`, TextFiller; the corpus source's `filler` option: another source's documents,
e.g. Wikitext or Python code), so that the facts stand among what a language model is trained on
and copying them is a small part of its loss, as in real documents. The document is
built as a list of pieces, each tokenized on its own, so that answer positions and distances are
exact for any tokenizer.

    RecallTask(min_gap=16, max_gap=16384, max_pairs=4, max_queries=4).documents(seed, n)  # training
    eval_document(rng, tokenizer, distances, n_pairs=1)                                   # evaluation

Facts come in several forms (`TEMPLATES`): the question above ("sentence"), or the key stated
again and its value expected to follow, as a name recurs in a document: "Silver fox code: 482913"
("label") or "silver_fox_code = 482913" ("assign"); or one drawn per fact from a family of key
styles, separators and placements ("varied": "sleepyAnchorToken: 270549", "gentle-meadow-tag :=
569765. "), which never draws the assign form. A training task may mix forms; the needle test
(elephant/needle.py) reads a form the training mix leaves out, so it measures recall, not a form.

As a corpus source (`open_source("recall", split)`, `data.source = "recall"`), each split draws its
documents from its own seed, so train, valid and test never share a document. Mixed into another
corpus (`data.recall_mix`, data_packing/sources.py), they are made of that corpus's own training
text as it comes (StreamFiller), with facts and queries set in it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from data_packing.errors import DataError

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case "
    "point government company number group problem fact water room mother area money story month "
    "lot right study book word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health art war history party result "
    "change morning reason research girl guy moment air teacher force education river garden road "
    "window music table paper letter field market light voice plan sound island bridge mountain "
    "ship train forest village castle station valley harbor tower engine bottle basket "
    "make go see know take get give find think tell become leave feel bring begin keep hold write "
    "stand hear let mean set meet run pay sit speak lie lead read grow lose fall send build stay "
    "walk carry open close watch follow stop create turn move live believe happen remember "
    "good new first last long great little own other old right big high different small large next "
    "early young important few public bad same able quiet green dark warm cold simple strange "
    "slowly often never always again still together almost already soon however perhaps"
).split()
ADJECTIVES = ("silver golden red blue green amber crimson violet copper iron wooden glass marble "
              "hidden ancient northern southern eastern western quiet sleepy brave clever gentle "
              "swift lonely broken painted frozen").split()
NOUNS = ("fox owl lantern river castle garden tower bridge harbor mountain forest violin compass "
         "anchor dragon falcon meadow island temple library kettle mirror canyon comet "
         "glacier orchard beacon cellar drum feather").split()
PASSKEY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
N_DIGITS = 6


def keys() -> list[str]:
    """Every key: 'the silver fox', ... (29 x 30 = 870 of them)."""
    return [f"the {a} {n}" for a in ADJECTIVES for n in NOUNS]


def _label(key: str) -> str:
    """'the silver fox' -> 'Silver fox'."""
    name = key.removeprefix("the ")
    return name[:1].upper() + name[1:]


def _ident(key: str) -> str:
    """'the silver fox' -> 'silver_fox_code'."""
    return key.removeprefix("the ").replace(" ", "_") + "_code"


# How a fact is stated and asked for: name -> (fact, query), each (key, value) -> (before, value
# piece, after). "sentence" asks a question; "label" and "assign" state the key again and expect
# the value to follow it, as a name recurs in a document (the needle test: a key repeated N tokens
# later). A value piece may open with a space, so that a BPE tokenizer reads it as it reads running
# text (" 482913", not a space token and "482913"); the space is not scored (`answer_span`).
TEMPLATES = {
    "sentence": (lambda k, v: (f"The code of {k} is ", v, ". "),
                 lambda k, v: (f"What is the code of {k}? It is ", v, ". ")),
    "label": (lambda k, v: (f"\n{_label(k)} code:", " " + v, "\n"),
              lambda k, v: (f"\n{_label(k)} code:", " " + v, "\n")),
    "assign": (lambda k, v: (f"\n{_ident(k)} =", " " + v, "\n"),
               lambda k, v: (f"\n{_ident(k)} =", " " + v, "\n")),
    # one of many forms, drawn per fact: the key written in one of several styles, one of several
    # separators, on a line of its own or inside running text. No fixed pair: build_document
    # draws each fact's from `varied_form`
    "varied": None,
}
# what a varied fact names (the key's last word) and how it writes the key
SUFFIXES = ("code", "id", "key", "number", "pin", "port", "seed", "serial", "tag", "token")
KEY_STYLES = {
    "snake": lambda w: "_".join(w),                                    # silver_fox_code
    "camel": lambda w: w[0] + "".join(x.title() for x in w[1:]),       # silverFoxCode
    "kebab": lambda w: "-".join(w),                                    # silver-fox-code
    "upper": lambda w: "_".join(w).upper(),                            # SILVER_FOX_CODE
    "title": lambda w: " ".join(w).capitalize(),                       # Silver fox code
    "dotted": lambda w: ".".join(w),                                   # silver.fox.code
    "phrase": lambda w: f"the {w[-1]} of the {' '.join(w[:-1])}",      # the code of the silver fox
}
# a separator's text before the value piece, and whether the value piece opens with a space
SEPARATORS = ((":", True), (" =", True), (" is", True), (" ->", True), (" =>", True),
              (" :=", True), ("=", False), (":", False), ("\t", False), (" equals", True))


def varied_form(rng: np.random.Generator):
    """A (fact, query) pair of TEMPLATES' kind drawn at random: the key in one of KEY_STYLES with one
    of SUFFIXES, one of SEPARATORS, on a line of its own or inside running text; the query states
    the key again as the fact did. Never the needle's default form ("assign": a snake_case key and
    " ="), so that the needle test still reads a form the training mix leaves out."""
    styles = list(KEY_STYLES)
    style = styles[int(rng.integers(0, len(styles)))]
    suffix = SUFFIXES[int(rng.integers(0, len(SUFFIXES)))]
    seps = [s for s in SEPARATORS if not (style == "snake" and s[0] == " =")]
    sep, space = seps[int(rng.integers(0, len(seps)))]
    own_line = bool(rng.integers(0, 2))
    lead, tail = ("\n", "\n") if own_line else (" ", ". ")

    def say(k: str, v: str) -> tuple[str, str, str]:
        words = k.removeprefix("the ").split() + [suffix]
        return f"{lead}{KEY_STYLES[style](words)}{sep}", (" " if space else "") + v, tail
    return say, say


def check_templates(names) -> tuple[str, ...]:
    """The template names as a tuple, each checked against TEMPLATES (a DataError naming the
    accepted ones)."""
    names = tuple(names)
    bad = [n for n in names if n not in TEMPLATES]
    if bad or not names:
        raise DataError(f"recall: unknown fact template {bad[0] if bad else '(none)'!r}; "
                        f"accepted: {', '.join(TEMPLATES)}")
    return names


def answer_span(tokenizer, ids: list[int]) -> int:
    """How many of a value piece's first tokens are whitespace alone (not part of the answer)."""
    n = 0
    while n < len(ids) - 1 and not tokenizer.decode([ids[n]]).strip():
        n += 1
    return n


class Filler:
    """Filler text of about `n` tokens from a seeded generator (see the module docstring)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def words(self, n_words: int) -> str:
        w = np.asarray(WORDS)[self.rng.integers(0, len(WORDS), n_words)]
        out, i = [], 0
        while i < n_words:
            k = int(self.rng.integers(5, 16))
            sent = " ".join(w[i:i + k])
            out.append(sent[:1].upper() + sent[1:] + ". ")
            i += k
        return "".join(out)

    def numbers(self, n_words: int) -> str:
        out, made = [], 0
        while made < n_words:
            num = int(self.rng.integers(0, 10 ** int(self.rng.integers(1, 7))))
            a, b = (WORDS[int(i)] for i in self.rng.integers(0, len(WORDS), 2))
            out.append(f"There were {num} {a}s near the {b}. ")
            made += 6
        return "".join(out)

    def passkey(self, n_words: int) -> str:
        reps = max(1, math.ceil(n_words / len(PASSKEY.split())))
        return PASSKEY * reps

    def piece(self, need: int) -> str:
        """The next stretch of filler, of any length (`need`: the characters still wanted)."""
        kind = int(self.rng.integers(0, 3))
        n_words = int(self.rng.integers(20, 400))
        return (self.words, self.numbers, self.passkey)[kind](n_words)

    def extend(self, text: str, n_chars: int) -> str:
        """`text` continued by about `n_chars` characters with no more draws of `rng`: by its own
        start, so that a document's other parts stay those its draws gave (build_document)."""
        return text + " " + text[:n_chars]

    def text(self, n_chars: int) -> str:
        """About `n_chars` characters of filler (cut at a word boundary)."""
        parts, have = [], 0
        while have < n_chars:
            parts.append(self.piece(n_chars - have))
            have += len(parts[-1])
        s = "".join(parts)
        if len(s) > n_chars:
            cut = s.rfind(" ", 0, n_chars)
            s = s[:cut + 1] if cut > 0 else s[:n_chars]
        return s


class TextFiller(Filler):
    """Filler cut from a real text (`corpus`, e.g. a source's documents joined): stretches that
    start at a random word, so the facts stand in prose or code as a document would have them."""

    def __init__(self, rng: np.random.Generator, corpus: str):
        super().__init__(rng)
        if len(corpus) < 64:
            raise DataError(f"recall filler: the text has {len(corpus)} characters; it needs "
                            "at least 64")
        self.corpus = corpus

    def piece(self, need: int) -> str:
        start = int(self.rng.integers(0, len(self.corpus)))
        space = self.corpus.find(" ", start)
        start = space + 1 if 0 <= space < len(self.corpus) - 1 else 0
        return self.corpus[start:start + need + 32]


class StreamEnd(Exception):
    """A StreamFiller's documents ran out before a stretch was whole."""


class StreamFiller(Filler):
    """Filler read from a stream of documents in their order, each character once: the stretches
    follow one another (documents joined by blank lines, each stretch cut at a word boundary and
    the rest kept for the next), so that recall documents made with it are the stream's own text
    with facts and queries set in it, and repeat none of it. `docs`: an iterator of texts, which
    the caller may go on reading (what this filler has not taken); StreamEnd when it runs out,
    `rest()` the text taken and not yet used."""

    def __init__(self, docs):
        super().__init__(np.random.default_rng(0))   # draws nothing: the stream is the text
        self.docs, self.buf, self.pos = docs, "", 0

    def _have(self, n: int) -> None:
        while len(self.buf) - self.pos < n:
            doc = next(self.docs, None)
            if doc is None:
                raise StreamEnd
            left = self.buf[self.pos:]
            self.buf, self.pos = left + ("\n\n" if left else "") + doc, 0

    def text(self, n_chars: int) -> str:
        self._have(n_chars + 1)
        end = self.pos + n_chars
        if self.buf[end] != " ":   # mid-word: end at the word before, or after this one
            cut = self.buf.rfind(" ", self.pos, end)
            if cut <= self.pos:   # no word ends inside: end after this one
                at = end - self.pos   # from pos: reading more rebuilds the buffer from pos
                while (cut := self.buf.find(" ", self.pos + at)) < 0:   # a word running on
                    self._have(len(self.buf) - self.pos + 1)
            end = cut + 1
        s, self.pos = self.buf[self.pos:end], end
        return s

    def extend(self, text: str, n_chars: int) -> str:
        """`text` continued by the stream's next characters: it draws nothing and repeats none."""
        return text + self.text(n_chars)

    def rest(self) -> str:
        out, self.buf, self.pos = self.buf[self.pos:], "", 0
        return out


def make_filler(rng: np.random.Generator, corpus) -> Filler:
    """The filler of a document: synthetic (`corpus` None), cut from a text (a str), or `corpus`
    itself when it is a Filler already (the mix's StreamFiller, shared by its documents)."""
    if isinstance(corpus, Filler):
        return corpus
    return Filler(rng) if corpus is None else TextFiller(rng, corpus)


@dataclass
class Query:
    key: int           # index into the document's facts
    answer_start: int  # token index of the first answer token
    answer_len: int    # answer tokens
    distance: int      # tokens from the key's previous mention to the first answer token


@dataclass
class RecallDocument:
    tokens: np.ndarray          # (L,) int64
    queries: list[Query]
    text: str


def value(rng: np.random.Generator, digits: int = N_DIGITS) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, digits))


def build_document(rng: np.random.Generator, tokenizer, n_pairs: int, plan: list[tuple[int, int]],
                   lead: int = 0, digits: int = N_DIGITS, filler: str | Filler | None = None,
                   template: str = "sentence") -> RecallDocument:
    """Facts for `n_pairs` random keys after `lead` characters of filler, then one query per
    (key index, distance) of `plan`: filler until the answer stands `distance` tokens after the
    key's previous mention (or right away when the previous queries already went further).
    Values have `digits` digits. `filler`: a text to cut the filler from (TextFiller), a Filler
    to read it from (StreamFiller), None for the synthetic mix (Filler). `template`: how facts
    are stated and asked (TEMPLATES)."""
    filler = make_filler(rng, filler)
    all_keys = keys()
    chosen = rng.choice(len(all_keys), size=n_pairs, replace=False)
    names = [all_keys[int(i)] for i in chosen]
    values = [value(rng, digits) for _ in range(n_pairs)]
    # each fact's (fact, query) form; "varied" draws one per fact (the other templates draw none,
    # so their documents are the ones they always were)
    forms = ([varied_form(rng) for _ in range(n_pairs)] if template == "varied"
             else [TEMPLATES[template]] * n_pairs)
    pieces: list[list[int]] = []
    texts: list[str] = []
    length = 0

    def add(text: str) -> int:
        nonlocal length
        ids = tokenizer.encode(text) if text else []
        pieces.append(ids)
        texts.append(text)
        start = length
        length += len(ids)
        return start

    if lead:
        add(filler.text(lead))
    last_mention = []
    for k in range(n_pairs):
        before, val, after = forms[k][0](names[k], values[k])
        add(before)
        start = add(val)
        last_mention.append(start + len(pieces[-1]))   # the token after the value
        add(after)
    queries = []
    for k, distance in plan:
        before, answer, after = forms[k][1](names[k], values[k])
        before_ids = tokenizer.encode(before)
        skip = answer_span(tokenizer, tokenizer.encode(answer))   # a leading space: not scored
        need = last_mention[k] - 1 + distance - len(before_ids) - skip - length   # filler tokens
        if need > 0:
            # characters per token of this tokenizer on filler, refined once; then, while still
            # short (a BPE tokenizer reads several characters a token, and a cut at a word loses
            # some), the stretch is continued with no more draws of `rng` (Filler.extend), so
            # the document's other parts are those the single refinement gave
            text = filler.text(need)
            got = len(tokenizer.encode(text))
            if got and got < need:
                text = text + filler.text(int((need - got) * len(text) / got) + 1)
                got = len(tokenizer.encode(text))
            for _ in range(16):
                if not got or got >= need:
                    break
                text = filler.extend(text, int((need - got) * len(text) / got) + 8)
                got = len(tokenizer.encode(text))
            ids = tokenizer.encode(text)[:need]
            pieces.append(list(ids))
            texts.append(tokenizer.decode(ids))
            length += len(ids)
        add(before)
        start = add(answer) + skip
        n = len(pieces[-1]) - skip
        queries.append(Query(k, start, n, start - (last_mention[k] - 1)))
        last_mention[k] = start + n
        add(after)
    tokens = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=length)
    return RecallDocument(tokens, queries, "".join(texts))


class RecallTask:
    """The training distribution: 1..max_pairs facts of `digits`-digit values, 1..max_queries
    queries, each at a distance drawn log-uniformly from [min_gap, max_gap] tokens, after a lead of
    0..min_gap*4 characters; each document in one of `templates` (TEMPLATES), drawn per document."""

    def __init__(self, min_gap: int = 16, max_gap: int = 16384, max_pairs: int = 4,
                 max_queries: int = 4, digits: int = N_DIGITS, filler: str | None = None,
                 templates=("sentence",)):
        if not 1 <= min_gap <= max_gap:
            raise DataError(f"recall: need 1 <= min_gap <= max_gap, got {min_gap}, {max_gap}")
        if max_pairs < 1 or max_queries < 1:
            raise DataError(f"recall: max_pairs and max_queries must be >= 1, got {max_pairs}, "
                            f"{max_queries}")
        self.min_gap, self.max_gap = min_gap, max_gap
        if digits < 1:
            raise DataError(f"recall: values need at least one digit, got {digits}")
        self.max_pairs, self.max_queries, self.digits = max_pairs, max_queries, digits
        # the text filler is cut from, or a Filler to read (build_document); None: synthetic
        self.filler = filler
        self.templates = check_templates(templates)

    def document(self, rng: np.random.Generator, tokenizer) -> RecallDocument:
        n_pairs = int(rng.integers(1, self.max_pairs + 1))
        n_queries = int(rng.integers(1, self.max_queries + 1))
        lo, hi = math.log(self.min_gap), math.log(self.max_gap)
        plan = [(int(rng.integers(0, n_pairs)), int(round(math.exp(rng.uniform(lo, hi)))))
                for _ in range(n_queries)]
        # one template: no draw, so a single-template task makes the documents it always made
        template = (self.templates[0] if len(self.templates) == 1
                    else self.templates[int(rng.integers(0, len(self.templates)))])
        return build_document(rng, tokenizer, n_pairs, plan, lead=int(rng.integers(0, 4 * self.min_gap + 1)),
                              digits=self.digits, filler=self.filler, template=template)

    def texts(self, seed: int, n_docs: int):
        """`n_docs` document texts (characters are tokens for the byte tokenizer)."""
        from data_packing.tokenizer import ByteTokenizer
        rng = np.random.default_rng(seed)
        tok = ByteTokenizer()
        for _ in range(n_docs):
            yield self.document(rng, tok).text


def eval_document(rng: np.random.Generator, tokenizer, distances: list[int], n_pairs: int = 1,
                  digits: int = N_DIGITS, filler: str | None = None,
                  template: str = "sentence") -> RecallDocument:
    """One evaluation document: `n_pairs` facts, then query j asks key j % n_pairs at distance
    distances[j] from that key's previous mention (n_pairs=1: one fact, asked again and again).
    `filler` and `template` as for build_document."""
    plan = [(j % n_pairs, d) for j, d in enumerate(distances)]
    return build_document(rng, tokenizer, n_pairs, plan, lead=int(rng.integers(0, 64)), digits=digits,
                          filler=filler, template=check_templates([template])[0])


SPLIT_SEEDS = {"train": 1, "valid": 2, "test": 3}
