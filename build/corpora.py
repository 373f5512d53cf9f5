"""Build the offline training corpora of the default model pair (issue 3).

Three domains, each written as JSON Lines documents ``{"id", "source", "text"}`` under
``<out>/<domain>/{train,valid}.jsonl``:

- ``code``: the Python 3.11 standard library sources (no test packages). Licence: PSF-2.0.
- ``json``: records, arrays, API responses, configs, logs, made by a seeded ``faker`` generator
  with varied indentation and key styles. Synthetic, no licence restriction.
- ``prose``: public-domain and freely licensed English text from Debian packages: the World English
  Bible (``sword-text-web`` read with ``mod2imp`` from ``libsword-utils``), ``fortunes``,
  ``dict-devil`` (Ambrose Bierce, The Devil's Dictionary) and the reST sources of ``python3.11-doc``.

Every step is deterministic: files are read in sorted order, the JSON generator is seeded, and the
held-out split is chosen by a hash of each document id until at least ``--valid-frac`` of each
domain's characters are held out. ``manifest.json`` records counts and a digest per split.

Usage: ``python build/corpora.py --out data/corpora`` (needs the Debian packages above for prose;
``apt-get install sword-text-web libsword-utils fortunes dict-devil python3.11-doc``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

Doc = dict[str, str]

DOMAINS = ("code", "json", "prose")
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNES_SKIP = {"ascii-art"}
DEVIL_DICT = Path("/usr/share/dictd/devil.dict.dz")
DEVIL_INDEX = Path("/usr/share/dictd/devil.index")
PYDOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
SWORD_MODULE = "engWEB2015eb"
JSON_REFERENCE_DATE = datetime(2026, 11, 30, 23, 35)

SOURCES = {
    "stdlib": "Python 3.11 standard library sources, tests excluded (PSF-2.0)",
    "faker-json": "synthetic JSON from a seeded faker generator (no restriction)",
    "web-bible": "World English Bible, Debian sword-text-web via mod2imp (public domain)",
    "fortunes": "Debian fortunes, BSD fortune(6) data files (freely redistributable, BSD package)",
    "devil": "Ambrose Bierce, The Devil's Dictionary, Debian dict-devil (public domain)",
    "pydoc": "Python 3.11 documentation reST sources, Debian python3.11-doc (PSF-2.0)",
}


# --------------------------------------------------------------------------------------------- code
def stdlib_dir() -> Path:
    """Return the system Python 3.11 standard library folder (Debian's first, else this Python's)."""
    debian = Path("/usr/lib/python3.11")
    if (debian / "os.py").exists():
        return debian
    return Path(sysconfig.get_paths()["stdlib"])


def code_docs(root: Path | None = None) -> Iterator[Doc]:
    """Yield every stdlib ``.py`` file outside test packages, in sorted path order."""
    root = root or stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if rel.parts[0].startswith("config-"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            yield {"id": f"stdlib/{rel.as_posix()}", "source": "stdlib", "text": text + "\n"}


# --------------------------------------------------------------------------------------------- json
class JsonGen:
    """Seeded generator of realistic JSON documents."""

    def __init__(self, seed: int) -> None:
        from faker import Faker

        self.rng = random.Random(seed)
        self.fake = Faker("en_US")
        self.fake.seed_instance(seed)
        self.camel = False

    def key(self, name: str) -> str:
        """Return ``name`` (snake_case) in the document's key style."""
        if not self.camel:
            return name
        head, *rest = name.split("_")
        return head + "".join(p.capitalize() for p in rest)

    def obj(self, **items: object) -> dict[str, object]:
        """Build a dict with styled keys."""
        return {self.key(k): v for k, v in items.items()}

    def ts(self) -> str:
        """An ISO 8601 timestamp in the three years before a fixed date (never "now": keeps builds identical)."""
        end = JSON_REFERENCE_DATE
        return self.fake.date_time_between(end - timedelta(days=1095), end).strftime("%Y-%m-%dT%H:%M:%SZ")

    def money(self, lo: float = 1, hi: float = 500) -> float:
        """A price with two decimals."""
        return round(self.rng.uniform(lo, hi), 2)

    def address(self) -> dict[str, object]:
        f = self.fake
        return self.obj(
            street=f.street_address(), city=f.city(), state=f.state_abbr(), postal_code=f.postcode(),
            country=f.country_code(),
        )

    def user(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        d = self.obj(
            id=r.randint(1, 99999), uuid=f.uuid4(), username=f.user_name(), name=f.name(),
            email=f.email(), phone=f.phone_number(), is_active=r.random() < 0.8,
            created_at=self.ts(), address=self.address(),
        )
        if r.random() < 0.6:
            d[self.key("company")] = self.obj(name=f.company(), catch_phrase=f.catch_phrase(), bs=f.bs())
        if r.random() < 0.7:
            d[self.key("tags")] = [f.word() for _ in range(r.randint(0, 5))]
        if r.random() < 0.4:
            d[self.key("roles")] = r.sample(["admin", "editor", "viewer", "owner", "billing", "support"],
                                            r.randint(1, 3))
        if r.random() < 0.3:
            d[self.key("last_login")] = None if r.random() < 0.3 else self.ts()
        return d

    def product(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        return self.obj(
            sku=f.bothify("??-#####").upper(), name=" ".join(f.words(r.randint(1, 3))).title(),
            description=f.sentence(r.randint(6, 16)), price=self.money(), currency=f.currency_code(),
            in_stock=r.random() < 0.75, quantity=r.randint(0, 500),
            categories=[f.word() for _ in range(r.randint(1, 3))],
            rating=round(r.uniform(1, 5), 1), dimensions=self.obj(
                width=round(r.uniform(1, 100), 1), height=round(r.uniform(1, 100), 1),
                depth=round(r.uniform(1, 100), 1), unit=r.choice(["cm", "in", "mm"])),
        )

    def order(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        items = []
        for _ in range(r.randint(1, 5)):
            q, p = r.randint(1, 6), self.money(2, 200)
            items.append(self.obj(product_id=r.randint(1000, 9999), name=f.word().title(), quantity=q,
                                  unit_price=p, total=round(q * p, 2)))
        subtotal = round(sum(i[self.key("total")] for i in items), 2)  # type: ignore[misc]
        tax = round(subtotal * 0.08, 2)
        return self.obj(
            order_id=f.bothify("ORD-########"), customer=self.obj(id=r.randint(1, 99999), name=f.name(),
                                                                 email=f.email()),
            status=r.choice(["pending", "paid", "shipped", "delivered", "cancelled", "refunded"]),
            items=items, subtotal=subtotal, tax=tax, total=round(subtotal + tax, 2),
            shipping_address=self.address(), created_at=self.ts(),
            notes=f.sentence() if r.random() < 0.3 else None,
        )

    def event(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        lvl = r.choice(["DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR"])
        return self.obj(
            timestamp=self.ts(), level=lvl, service=r.choice(["api", "auth", "billing", "worker", "gateway"]),
            message=f.sentence(r.randint(4, 10)), request_id=f.uuid4(), ip=f.ipv4(),
            duration_ms=r.randint(1, 3000), status_code=r.choice([200, 200, 201, 204, 400, 401, 404, 500]),
        )

    def api_response(self) -> dict[str, object]:
        r = self.rng
        kind = r.choice([self.user, self.product, self.order, self.event])
        n = r.randint(1, 4)
        page, per = r.randint(1, 20), r.choice([10, 20, 25, 50])
        return self.obj(
            status="ok", code=200, data=[kind() for _ in range(n)],
            pagination=self.obj(page=page, per_page=per, total=r.randint(n, 5000),
                                next=f"/api/v{r.randint(1, 3)}/items?page={page + 1}"),
            meta=self.obj(request_id=self.fake.uuid4(), elapsed_ms=r.randint(1, 900), version=f"1.{r.randint(0, 9)}"),
        )

    def error_response(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        code = r.choice([400, 401, 403, 404, 409, 422, 429, 500, 503])
        d = self.obj(error=self.obj(code=code, type=r.choice(["invalid_request", "not_found", "rate_limited",
                                                              "internal_error", "unauthorized"]),
                                    message=f.sentence(), details=[self.obj(field=f.word(), issue=f.sentence(5))
                                                                   for _ in range(r.randint(0, 3))]),
                     request_id=f.uuid4(), timestamp=self.ts())
        return d

    def config(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        return self.obj(
            name=f.slug(), version=f"{r.randint(0, 5)}.{r.randint(0, 20)}.{r.randint(0, 9)}",
            debug=r.random() < 0.3, server=self.obj(host=r.choice(["0.0.0.0", "localhost", f.ipv4()]),
                                                     port=r.choice([80, 443, 8000, 8080, 8443, 9000]),
                                                     workers=r.randint(1, 32), timeout_s=r.randint(5, 120)),
            database=self.obj(url=f"postgresql://{f.user_name()}@{f.domain_name()}:5432/{f.word()}",
                              pool_size=r.randint(1, 50), ssl=r.random() < 0.5),
            features={f.word(): r.random() < 0.5 for _ in range(r.randint(1, 5))},
            logging=self.obj(level=r.choice(["debug", "info", "warning"]), format=r.choice(["json", "text"])),
        )

    def geojson(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        feats = []
        for _ in range(r.randint(1, 4)):
            feats.append({"type": "Feature", "geometry": {"type": "Point", "coordinates": [
                round(float(f.longitude()), 6), round(float(f.latitude()), 6)]},
                "properties": self.obj(name=f.city(), population=r.randint(100, 9_000_000))})
        return {"type": "FeatureCollection", "features": feats}

    def transaction(self) -> dict[str, object]:
        f, r = self.fake, self.rng
        return self.obj(
            transaction_id=f.uuid4(), account=f.iban(), amount=self.money(-2000, 5000),
            currency=f.currency_code(), merchant=f.company(), category=r.choice(
                ["groceries", "travel", "utilities", "salary", "rent", "dining"]),
            booked_at=self.ts(), pending=r.random() < 0.1,
        )

    def document(self) -> object:
        """One JSON value of a randomly chosen kind."""
        r = self.rng
        self.camel = r.random() < 0.35
        kinds = [self.user, self.product, self.order, self.event, self.api_response, self.api_response,
                 self.error_response, self.config, self.geojson, self.transaction]
        kind = r.choice(kinds)
        if r.random() < 0.2:
            return [kind() for _ in range(r.randint(2, 5))]
        return kind()

    def render(self, value: object) -> str:
        """Serialise ``value`` with a randomly chosen layout."""
        r = self.rng.random()
        if r < 0.45:
            return json.dumps(value, indent=2, ensure_ascii=False)
        if r < 0.7:
            return json.dumps(value, indent=4, ensure_ascii=False)
        if r < 0.8:
            return json.dumps(value, ensure_ascii=False)
        if r < 0.88:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        if r < 0.93:
            return json.dumps(value, indent="\t", ensure_ascii=False)
        # JSON Lines: one compact record per line
        items = value if isinstance(value, list) else [self.event() for _ in range(self.rng.randint(3, 8))]
        return "\n".join(json.dumps(v, ensure_ascii=False) for v in items)


def json_docs(n: int, seed: int = 1234) -> Iterator[Doc]:
    """Yield ``n`` synthetic JSON documents from a generator seeded with ``seed``."""
    gen = JsonGen(seed)
    for i in range(n):
        yield {"id": f"faker-json/{i:06d}", "source": "faker-json", "text": gen.render(gen.document()) + "\n"}


# -------------------------------------------------------------------------------------------- prose
_NOTE = re.compile(r"<note\b.*?</note>", re.S)
_TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
_BREAK = re.compile(r'<div eID="[^"]*" type="x-p"/>|<lb\b[^>]*/>|</l>|<lg\b[^>]*/?>|</lg>|<chapter\b[^>]*/>')
_TAG = re.compile(r"<[^>]+>")
_HEAD = re.compile(r"^\$\$\$(.+?) (\d+):(\d+)$")


def _clean_osis(raw: str) -> str:
    """Turn one verse of OSIS markup into plain text with paragraph/line breaks."""
    s = _NOTE.sub("", raw)
    s = _TITLE.sub(lambda m: "\n" + m.group(1) + "\n", s)
    s = _BREAK.sub("\n", s)
    s = _TAG.sub("", s)
    s = re.sub(r"[ \t]+", " ", s)
    return s


def bible_docs() -> Iterator[Doc]:
    """Yield one document per chapter of the World English Bible."""
    out = subprocess.run(["mod2imp", SWORD_MODULE], check=True, capture_output=True).stdout.decode("utf-8")
    chapters: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    key: tuple[str, int] | None = None
    for line in out.split("\n"):
        m = _HEAD.match(line)
        if m:
            key = (m.group(1), int(m.group(2)))
            if key not in chapters:
                chapters[key] = []
                order.append(key)
            continue
        if key is not None and line.strip() and key[1] > 0:
            chapters[key].append(line)
    for book, chap in order:
        text = " ".join(_clean_osis(v) for v in chapters[(book, chap)])
        text = "\n".join(p.strip() for p in text.split("\n"))
        text = re.sub(r"\n{3,}", "\n\n", text).strip()
        if text:
            yield {"id": f"web-bible/{book}/{chap:03d}", "source": "web-bible",
                   "text": f"{book} {chap}\n\n{text}\n"}


def fortune_docs(root: Path = FORTUNES_DIR, per_doc: int = 20) -> Iterator[Doc]:
    """Yield fortunes in groups of ``per_doc`` (separated by blank lines), file by file."""
    for path in sorted(root.iterdir()):
        if path.suffix in {".dat", ".u8"} or path.name in FORTUNES_SKIP or not path.is_file():
            continue
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        items = [f.strip("\n") for f in re.split(r"^%$", text, flags=re.M) if f.strip()]
        for i in range(0, len(items), per_doc):
            yield {"id": f"fortunes/{path.name}/{i // per_doc:04d}", "source": "fortunes",
                   "text": "\n\n".join(items[i:i + per_doc]) + "\n"}


def _b64(s: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    n = 0
    for ch in s:
        n = n * 64 + alphabet.index(ch)
    return n


def devil_docs(per_doc: int = 25) -> Iterator[Doc]:
    """Yield The Devil's Dictionary entries (from the dictd index), grouped ``per_doc`` at a time."""
    data = gzip.decompress(DEVIL_DICT.read_bytes())
    entries = []
    for line in DEVIL_INDEX.read_text(encoding="utf-8").splitlines():
        word, off, length = line.split("\t")[:3]
        if word.startswith("00-database"):
            continue
        entries.append((_b64(off), _b64(length)))
    entries = sorted(set(entries))
    texts = [data[o:o + n].decode("utf-8", errors="replace").strip("\n") for o, n in entries]
    texts = [re.sub(r"^ {2,}", "", t, flags=re.M) for t in texts]
    for i in range(0, len(texts), per_doc):
        yield {"id": f"devil/{i // per_doc:04d}", "source": "devil", "text": "\n\n".join(texts[i:i + per_doc]) + "\n"}


def pydoc_docs(root: Path = PYDOC_SOURCES) -> Iterator[Doc]:
    """Yield the reST sources of the Python 3.11 documentation."""
    for path in sorted(root.rglob("*.rst.txt")):
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            rel = path.relative_to(root).as_posix()
            yield {"id": f"pydoc/{rel}", "source": "pydoc", "text": text + "\n"}


def prose_docs() -> Iterator[Doc]:
    """Yield all prose documents."""
    yield from bible_docs()
    yield from fortune_docs()
    yield from devil_docs()
    yield from pydoc_docs()


# -------------------------------------------------------------------------------------------- split
def _hash(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


def split_docs(docs: list[Doc], valid_frac: float) -> tuple[list[Doc], list[Doc]]:
    """Hold out documents in hash order of their ids until ``valid_frac`` of the characters are held out.

    Sources are held out in proportion: each source contributes at least ``valid_frac`` of its own
    characters (and at least one document when it has two or more).
    """
    valid_ids: set[str] = set()
    by_source: dict[str, list[Doc]] = {}
    for d in docs:
        by_source.setdefault(d["source"], []).append(d)
    for group in by_source.values():
        total = sum(len(d["text"]) for d in group)
        held = 0
        for d in sorted(group, key=lambda d: _hash(d["id"])):
            if len(group) < 2 or held >= valid_frac * total:
                break
            valid_ids.add(d["id"])
            held += len(d["text"])
    train = [d for d in docs if d["id"] not in valid_ids]
    valid = [d for d in docs if d["id"] in valid_ids]
    return train, valid


def write_jsonl(path: Path, docs: list[Doc]) -> str:
    """Write ``docs`` as JSON Lines and return the sha256 of the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    path.write_bytes(body)
    return hashlib.sha256(body).hexdigest()


def read_jsonl(path: Path) -> list[Doc]:
    """Read a JSON Lines file written by :func:`write_jsonl`."""
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def build(out: Path, json_n: int, seed: int, valid_frac: float, domains: tuple[str, ...] = DOMAINS) -> dict:
    """Build the requested domains under ``out`` and return the manifest."""
    makers = {"code": lambda: list(code_docs()), "json": lambda: list(json_docs(json_n, seed)),
              "prose": lambda: list(prose_docs())}
    manifest: dict[str, object] = {"seed": seed, "valid_frac": valid_frac, "json_docs": json_n,
                                   "sources": SOURCES, "domains": {}}
    for dom in domains:
        docs = makers[dom]()
        train, valid = split_docs(docs, valid_frac)
        info: dict[str, object] = {}
        for name, part in (("train", train), ("valid", valid)):
            digest = write_jsonl(out / dom / f"{name}.jsonl", part)
            per_src: dict[str, int] = {}
            for d in part:
                per_src[d["source"]] = per_src.get(d["source"], 0) + len(d["text"])
            info[name] = {"docs": len(part), "chars": sum(len(d["text"]) for d in part),
                          "chars_by_source": per_src, "sha256": digest}
        manifest["domains"][dom] = info  # type: ignore[index]
        print(f"{dom}: train {info['train']['docs']} docs {info['train']['chars']:,} chars, "  # type: ignore[index]
              f"valid {info['valid']['docs']} docs {info['valid']['chars']:,} chars", file=sys.stderr)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/corpora"))
    ap.add_argument("--json-docs", type=int, default=16000, help="number of synthetic JSON documents")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--valid-frac", type=float, default=0.04, help="held-out fraction of characters (>=0.03)")
    ap.add_argument("--domains", default=",".join(DOMAINS))
    args = ap.parse_args(argv)
    build(args.out, args.json_docs, args.seed, args.valid_frac, tuple(args.domains.split(",")))


if __name__ == "__main__":
    main()
