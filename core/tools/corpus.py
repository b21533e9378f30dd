"""Procedural generator of simple English children's stories.

Why it exists: the bundled tiny model must be trained on text the project may
redistribute. Everything here is written for this project (MIT licence), so
the corpus — and the model trained on it — carries no third-party licence.

The generator is deliberately varied (hundreds of names, animals, objects,
places, adjectives and verb phrases; ten plot shapes; several phrasings per
plot step; dialogue) so that a small model learns grammar and story shape
rather than memorising a handful of lines. It is deterministic for a given
seed: `generate_stories(n, seed)` always returns the same list.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

GIRL_NAMES = """Lily Mia Emma Ava Zoe Lucy Ella Ruby Rosa Nina Sara Anna Maya Ivy Daisy
Chloe Grace Hannah Julia Kate Leah Molly Nora Olive Poppy Rose Sophie Tess Amy Bella
Clara Eva Fiona Hazel Iris Jane Kira Luna Mila Nell Pia Sally Tina Uma Vera Wendy
Alice Beth Cora Dora Elsie Freya Gemma Holly Jade Lena Mara Nadia Penny Rita""".split()

BOY_NAMES = """Tom Sam Ben Max Leo Jack Finn Noah Owen Luke Jake Tim Dan Eli Hugo
Adam Carl Dave Evan Felix Gus Henry Ian Joe Kai Liam Mark Ned Oscar Paul Ray Seth
Theo Vic Will Zack Alex Bruno Cody Dylan Ethan Frank George Harry Isaac Jonah Kevin
Louis Milo Nick Otto Peter Quinn Rob Simon Toby Victor Wes Arlo Jasper""".split()

# (animal, sound it makes): the sound appears in dialogue-free action lines.
ANIMALS = [
    ("cat", "meowed"),
    ("dog", "barked"),
    ("rabbit", "sniffed"),
    ("bunny", "hopped"),
    ("fox", "yipped"),
    ("bear", "growled"),
    ("owl", "hooted"),
    ("duck", "quacked"),
    ("frog", "croaked"),
    ("mouse", "squeaked"),
    ("pig", "oinked"),
    ("cow", "mooed"),
    ("sheep", "baaed"),
    ("horse", "neighed"),
    ("lion", "roared"),
    ("tiger", "roared"),
    ("monkey", "chattered"),
    ("elephant", "trumpeted"),
    ("bird", "sang"),
    ("puppy", "yapped"),
    ("kitten", "purred"),
    ("squirrel", "chattered"),
    ("turtle", "blinked"),
    ("goat", "bleated"),
    ("chicken", "clucked"),
    ("hen", "clucked"),
    ("goose", "honked"),
    ("deer", "sniffed"),
    ("hedgehog", "snuffled"),
    ("badger", "grunted"),
    ("otter", "squeaked"),
    ("seal", "barked"),
    ("penguin", "squawked"),
    ("parrot", "squawked"),
    ("zebra", "snorted"),
    ("giraffe", "hummed"),
    ("hippo", "grunted"),
    ("panda", "yawned"),
    ("koala", "yawned"),
    ("kangaroo", "thumped"),
    ("wolf", "howled"),
    ("raccoon", "chittered"),
    ("beaver", "slapped its tail"),
    ("butterfly", "fluttered"),
    ("bee", "buzzed"),
    ("ladybug", "crawled"),
    ("snail", "crept"),
    ("whale", "sang"),
    ("dolphin", "clicked"),
    ("crab", "clicked"),
    ("lamb", "bleated"),
    ("pony", "neighed"),
    ("donkey", "brayed"),
    ("goldfish", "blew bubbles"),
    ("robin", "chirped"),
    ("sparrow", "chirped"),
    ("crow", "cawed"),
    ("swan", "honked"),
    ("dragon", "roared"),
    ("dinosaur", "stomped"),
    ("unicorn", "neighed"),
    ("moose", "bellowed"),
    ("mole", "sniffed"),
]

PET_NAMES = """Pip Max Bella Coco Milo Rosie Buddy Daisy Pepper Sunny Biscuit Ginger
Patch Button Clover Dot Fluffy Honey Jelly Maple Nutmeg Peanut Pebble Pickle Rolo
Sparky Sprout Tiger Toffee Waffle Whiskers Ziggy Bramble Cookie Fudge Hazel Misty
Noodle Pudding Scout Snowy Teddy Twig Acorn Blossom Bubbles Crumb Dusty""".split()

SIZE_ADJ = "little small tiny big huge tall short young old fluffy".split()
COLOR_ADJ = """red blue green yellow orange purple pink brown black white gray golden
silver spotted striped""".split()
THING_ADJ = """shiny soft round bright new old smooth heavy light warm cold sparkly
bumpy fuzzy squishy wooden painted colorful special tiny big little pretty lovely
funny noisy quiet sticky fancy plain magic cozy""".split()
TRAIT_ADJ = """kind brave curious shy clever gentle cheerful friendly happy playful
careful busy helpful quiet silly smart polite honest patient sleepy bouncy funny
bold caring calm eager generous jolly lively loyal merry neat proud quick sweet
thoughtful wise""".split()
FEELINGS = """happy sad scared excited proud tired surprised worried angry calm glad
lonely nervous hungry sleepy cheerful curious grumpy thankful brave upset jolly""".split()
GOOD_FEELINGS = "happy excited proud glad cheerful thankful jolly calm".split()
BAD_FEELINGS = "sad scared worried lonely nervous upset grumpy".split()

OBJECTS = """ball kite hat book doll teddy bear drum boat train car truck robot
block puzzle crayon pencil paintbrush shell stone feather leaf flower balloon
blanket pillow cup bowl spoon box basket bag scarf mitten sock shoe boot coat
umbrella bucket shovel rope ribbon button key lamp clock bell whistle flute
guitar piano map compass flag tent wagon bicycle scooter sled swing marble
ring necklace bracelet crown wand star jar bottle candle brush comb mirror
sticker card letter picture painting stick pinecone acorn nut seed egg
pebble rock toy yo-yo spinning top jump rope rocket plane helicopter tractor
bus ship castle treehouse fort nest bone carrot apple pear banana cookie cake
pie sandwich kite string bubble wand backpack lunchbox notebook""".split("\n")
OBJECTS = [w for line in OBJECTS for w in line.split()]
OBJECTS = sorted(set(OBJECTS) - {"teddy", "bear", "spinning", "top", "jump", "rope", "yo-yo"}) + [
    "teddy bear",
    "spinning top",
    "jump rope",
    "yo-yo",
    "rope",
    "toy box",
    "music box",
    "picture book",
    "paper boat",
    "red wagon",
    "sand castle",
    "snow globe",
    "tea set",
]

FOODS = """apple banana pear orange cherry grape plum peach berry strawberry
blueberry carrot pea bean potato tomato corn pumpkin cookie cake muffin cupcake
pie sandwich biscuit cracker pancake waffle noodle cheese honey jam bread
soup pizza popcorn nut seed sweet""".split()

# (noun phrase, phrase for going there) — the second keeps prepositions right.
PLACES = [
    ("the park", "to the park"),
    ("the garden", "to the garden"),
    ("the forest", "into the forest"),
    ("the beach", "to the beach"),
    ("the farm", "to the farm"),
    ("the river", "down to the river"),
    ("the pond", "to the pond"),
    ("the lake", "to the lake"),
    ("the hill", "up the hill"),
    ("the meadow", "across the meadow"),
    ("the woods", "into the woods"),
    ("the zoo", "to the zoo"),
    ("the school", "to school"),
    ("the library", "to the library"),
    ("the market", "to the market"),
    ("the shop", "to the shop"),
    ("the bakery", "to the bakery"),
    ("the playground", "to the playground"),
    ("the field", "across the field"),
    ("the barn", "to the barn"),
    ("the kitchen", "into the kitchen"),
    ("the yard", "out to the yard"),
    ("the attic", "up to the attic"),
    ("the cave", "into the cave"),
    ("the mountain", "up the mountain"),
    ("the valley", "down to the valley"),
    ("the village", "to the village"),
    ("the town", "into town"),
    ("the city", "to the city"),
    ("the castle", "to the castle"),
    ("the island", "to the island"),
    ("the harbor", "to the harbor"),
    ("the jungle", "into the jungle"),
    ("the desert", "across the desert"),
    ("the orchard", "to the orchard"),
    ("the bridge", "to the bridge"),
    ("the well", "to the well"),
    ("the stream", "to the stream"),
    ("the swamp", "to the swamp"),
    ("the station", "to the station"),
    ("the museum", "to the museum"),
    ("the fair", "to the fair"),
    ("the circus", "to the circus"),
    ("the pool", "to the pool"),
    ("the lighthouse", "to the lighthouse"),
    ("the bus stop", "to the bus stop"),
    ("the hospital", "to the hospital"),
    ("the camp", "to the camp"),
    ("the greenhouse", "to the greenhouse"),
]

# Hiding spots: where a lost thing turns up.
SPOTS = """under the bed|behind the sofa|in the toy box|under a big leaf|behind the door|
in the grass|under the table|inside a boot|on top of the shelf|in the sandbox|
under the stairs|behind a tree|in the laundry basket|next to the fence|under a pillow|
in the garden shed|beside the pond|in a bush|under the car|inside the wagon|
in the flower bed|behind the curtain|under a blanket|in the closet|on the windowsill""".replace(
    "\n", ""
).split("|")

# (base form, past form) verb phrases: base for dialogue, past for narration.
ACTIVITIES = [
    ("play tag", "played tag"),
    ("fly a kite", "flew a kite"),
    ("build a sandcastle", "built a sandcastle"),
    ("play hide and seek", "played hide and seek"),
    ("read a book", "read a book"),
    ("draw pictures", "drew pictures"),
    ("paint a picture", "painted a picture"),
    ("sing a song", "sang a song"),
    ("dance in the rain", "danced in the rain"),
    ("jump in puddles", "jumped in puddles"),
    ("climb a tree", "climbed a tree"),
    ("ride bikes", "rode bikes"),
    ("bake cookies", "baked cookies"),
    ("plant seeds", "planted seeds"),
    ("pick flowers", "picked flowers"),
    ("collect shells", "collected shells"),
    ("build a fort", "built a fort"),
    ("play catch", "played catch"),
    ("skip stones", "skipped stones"),
    ("make a snowman", "made a snowman"),
    ("go swimming", "went swimming"),
    ("have a picnic", "had a picnic"),
    ("look for bugs", "looked for bugs"),
    ("play on the swings", "played on the swings"),
    ("race to the tree", "raced to the tree"),
    ("tell jokes", "told jokes"),
    ("play music", "played music"),
    ("blow bubbles", "blew bubbles"),
    ("roll down the hill", "rolled down the hill"),
    ("watch the clouds", "watched the clouds"),
    ("count the stars", "counted the stars"),
    ("feed the ducks", "fed the ducks"),
    ("play with blocks", "played with blocks"),
    ("make a card", "made a card"),
    ("build a tower", "built a tower"),
    ("play dress up", "played dress up"),
    ("make mud pies", "made mud pies"),
    ("sail a paper boat", "sailed a paper boat"),
    ("go on a treasure hunt", "went on a treasure hunt"),
    ("play a game", "played a game"),
    ("hop like frogs", "hopped like frogs"),
    ("chase butterflies", "chased butterflies"),
    ("look at the fish", "looked at the fish"),
    ("make a necklace", "made a necklace"),
    ("clean the room", "cleaned the room"),
    ("water the plants", "watered the plants"),
]

MOVES = """ran walked hopped skipped raced wandered tiptoed marched dashed hurried
strolled jogged trotted zoomed rushed crept stomped waddled scampered""".split()

SKILLS = [
    ("ride a bike", "rode the bike", "wobbled and fell over"),
    ("swim", "swam across the pool", "splashed and sank a little"),
    ("whistle", "whistled a happy tune", "only made a puff of air"),
    ("tie shoes", "tied the laces in a neat bow", "made a big knot"),
    ("read", "read the whole page", "mixed up the words"),
    ("jump rope", "jumped ten times in a row", "tripped on the rope"),
    ("skate", "skated around the pond", "slipped on the ice"),
    ("climb the big tree", "climbed to the top", "slid back down"),
    ("bake bread", "baked a warm loaf of bread", "made the bread too flat"),
    ("catch a ball", "caught the ball", "dropped the ball"),
    ("play the drum", "played a steady beat", "banged too loudly"),
    ("write a letter", "wrote a whole letter", "made the letters too big"),
    ("fly", "flew over the trees", "flapped and landed in a bush"),
    ("count to twenty", "counted all the way to twenty", "forgot what came after twelve"),
    ("dive", "dove into the water", "landed with a big splash"),
    ("paint a flower", "painted a beautiful flower", "made a big blob of paint"),
]

FEARS = [
    ("the dark", "the dark was just the night, and the stars were shining"),
    ("thunder", "thunder was only a loud noise from the clouds"),
    ("the big slide", "the slide was fast and fun"),
    ("deep water", "the water held them up when they kicked their legs"),
    ("the old barn", "the barn was full of friendly animals"),
    ("the big dog next door", "the dog only wanted to play"),
    ("the first day of school", "school was full of new friends"),
    ("the tall ladder", "the ladder was strong and safe"),
    ("the noisy vacuum", "the vacuum was just cleaning the floor"),
    ("the shadows on the wall", "the shadows were only shapes made by the lamp"),
    ("the wind at night", "the wind was only singing to the trees"),
    ("the doctor", "the doctor was kind and gentle"),
]

PROBLEMS = [
    (
        "a kite was stuck in a tall tree",
        "used a long stick to shake the branch",
        "the kite floated down",
    ),
    ("a ball had rolled into the pond", "used a net to pull it out", "the ball was safe again"),
    (
        "a little bird had fallen from its nest",
        "gently lifted it back up",
        "the bird chirped a thank you",
    ),
    ("a cat was stuck on the roof", "called for a tall ladder", "the cat climbed down safely"),
    (
        "the garden was dry and the flowers were drooping",
        "carried water in a bucket",
        "the flowers stood up tall",
    ),
    (
        "a friend's wagon had a broken wheel",
        "fixed it with a bit of string",
        "the wagon rolled again",
    ),
    (
        "the path was blocked by a fallen log",
        "pushed the log together with friends",
        "the path was clear",
    ),
    (
        "a puppy was lost in the rain",
        "shared an umbrella and looked for its home",
        "the puppy found its family",
    ),
    ("the sand tower kept falling down", "added some water to the sand", "the tower stood strong"),
    ("a box of toys had spilled everywhere", "picked up every toy one by one", "the room was tidy"),
]

HELPERS = [
    ("a wise old owl", "it"),
    ("a friendly bear", "it"),
    ("Mom", "she"),
    ("Dad", "he"),
    ("Grandma", "she"),
    ("Grandpa", "he"),
    ("a kind farmer", "he"),
    ("the teacher", "she"),
    ("a big brother", "he"),
    ("a big sister", "she"),
    ("a gentle giant", "he"),
    ("a busy squirrel", "it"),
    ("a clever crow", "it"),
    ("the baker", "she"),
    ("a kind neighbor", "he"),
    ("an old turtle", "it"),
]
FAMILY = ["mom", "dad", "grandma", "grandpa", "sister", "brother", "family", "aunt", "uncle"]

OPENERS = [
    "Once upon a time",
    "One day",
    "One sunny morning",
    "One rainy afternoon",
    "Long ago",
    "One cold winter day",
    "One warm summer evening",
    "One windy day",
    "Early one morning",
    "One bright spring day",
    "Last week",
    "One quiet night",
    "On a snowy day",
    "One fine day",
    "A long time ago",
    "One cloudy day",
    "In the middle of autumn",
]

WEATHER = [
    "The sun was shining and the sky was blue.",
    "It was raining, and the puddles were big.",
    "The wind was blowing the leaves around.",
    "Soft snow covered the ground.",
    "The clouds were gray, but it was warm.",
    "The air was fresh and cool.",
    "Birds were singing in the trees.",
    "The grass was wet with dew.",
]

# Morals per plot, so a story's lesson matches what happened in it.
MORALS = {
    "lost_object": ["It is okay to ask for help.", "Friends help each other."],
    "new_friend": [
        "Good friends are the best treasure.",
        "It is nice to say hello.",
        "A new friend can make any day better.",
    ],
    "fear": [
        "Being brave does not mean you are never scared.",
        "It is okay to be scared sometimes.",
    ],
    "sharing": ["Sharing makes everyone happy.", "A little kindness goes a long way."],
    "adventure": ["Every day can be an adventure.", "There is always something new to see."],
    "learning": ["If you keep trying, you can do it.", "Patience and practice go a long way."],
    "birthday": [
        "Giving a gift can feel as good as getting one.",
        "It is good to be kind to others.",
    ],
    "helping": ["Helping others feels good.", "A little kindness goes a long way."],
    "turns": ["Taking turns is fair.", "It is nice to say sorry."],
}

ENDINGS = [
    "{name} went to bed with a big smile.",
    "It was the best day ever.",
    "From that day on, they were best friends.",
    "{name} could not wait to do it again.",
    "And they all lived happily ever after.",
    "{name} fell asleep feeling {good}.",
    "That night, {name} dreamed about {place}.",
    "{name} hugged {poss} {family} and said goodnight.",
    "The end.",
    "{name} told {poss} {family} all about it at dinner.",
]


FRIEND_PLOTS = ("new_friend", "sharing", "birthday", "turns")


def article(word: str) -> str:
    """Return `word` with the right indefinite article ("an owl", "a cat")."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def cap(sentence: str) -> str:
    """Capitalise the first letter only (keeps proper nouns later in the line)."""
    return sentence[:1].upper() + sentence[1:]


@dataclass(frozen=True)
class Hero:
    """A story's main character and the words that refer to them."""

    name: str
    desc: str  # e.g. "a little girl named Lily", "a fluffy white rabbit named Pip"
    short: str  # the description without article or name: "little girl", "fluffy white rabbit"
    kind: str  # "girl", "boy" or an animal noun
    subj: str  # he / she
    obj: str  # him / her
    poss: str  # his / her


class StoryWriter:
    """Writes one story at a time from a seeded random generator."""

    def __init__(self, rng: random.Random) -> None:
        self.r = rng

    # ---- building blocks -------------------------------------------------
    def pick(self, items):
        return self.r.choice(items)

    def hero(self, exclude: str = "") -> Hero:
        r = self.r
        girl = r.random() < 0.5
        subj, obj, poss = ("she", "her", "her") if girl else ("he", "him", "his")
        if r.random() < 0.55:
            names = GIRL_NAMES if girl else BOY_NAMES
            name = r.choice([n for n in names if n != exclude])
            kind = "girl" if girl else "boy"
            trait = r.choice(TRAIT_ADJ + SIZE_ADJ[:3])
            short = f"{trait} {kind}"
            desc = f"{article(short)} named {name}"
        else:
            kind = r.choice(ANIMALS)[0]
            name = r.choice([n for n in PET_NAMES if n != exclude])
            adj = r.choice(SIZE_ADJ + TRAIT_ADJ)
            if r.random() < 0.5:
                adj = f"{adj} {r.choice(COLOR_ADJ)}"
            short = f"{adj} {kind}"
            desc = f"{article(short)} named {name}"
        return Hero(name, desc, short, kind, subj, obj, poss)

    def thing(self) -> str:
        adj = self.pick(THING_ADJ + COLOR_ADJ)
        return f"{adj} {self.pick(OBJECTS)}"

    def said(self, who: str, line: str) -> str:
        """A line of dialogue, with the tag before or after it."""
        verb = self.pick(
            [
                "said",
                "said",
                "said",
                "asked" if line.endswith("?") else "shouted",
                "whispered",
                "cried",
                "replied",
            ]
        )
        if line.endswith("?"):
            verb = self.pick(["asked", "asked", "wondered"])
        if self.r.random() < 0.7:
            tail = line[:-1] + "," if line.endswith(".") else line
            return f'"{tail}" {verb} {who}.'
        return f'{cap(who)} {verb}, "{line}"'

    def opening(self, h: Hero) -> list[str]:
        r = self.r
        self.main = h  # remembered so a chat request can name the story's hero
        opener = self.pick(OPENERS)
        place = self.pick(PLACES)[0]
        did = self.pick(
            [
                "woke up early",
                "went outside to play",
                "sat by the window",
                f"walked {self.pick(PLACES)[1]}",
            ]
        )
        forms = [
            f"{opener}, there was {h.desc}.",
            f"{opener}, {h.desc} lived near {place}.",
            f"{opener}, {h.desc} woke up early.",
            f"{opener}, {h.desc} went outside to play.",
            # Openings that start from a name or "The ...", as prompts often do.
            f"{opener}, {h.name} {did}. {cap(h.subj)} was {article(h.short)}.",
            f"{h.name} was {article(h.short)} who lived near {place}.",
            f"The {h.short} was called {h.name}. {cap(h.subj)} lived near {place}.",
            f"The {h.short} named {h.name} {did}.",
        ]
        out = [self.pick(forms)]
        if r.random() < 0.6:
            out.append(
                cap(
                    f"{h.subj} was very {self.pick(TRAIT_ADJ)} and loved to "
                    f"{self.pick(ACTIVITIES)[0]}."
                )
            )
        if r.random() < 0.4:
            out.append(self.pick(WEATHER))
        return out

    def ending(self, h: Hero, place: str = "", plot: str = "") -> list[str]:
        r = self.r
        out = []
        if plot in MORALS and r.random() < 0.45:
            out.append(self.pick(MORALS[plot]))
        # A "best friends" ending only fits plots with two friends in them.
        endings = ENDINGS if plot in FRIEND_PLOTS else [e for e in ENDINGS if "they" not in e]
        end = self.pick(endings).format(
            name=h.name,
            good=self.pick(GOOD_FEELINGS),
            poss=h.poss,
            family=self.pick(FAMILY),
            place=place or self.pick(PLACES)[0],
        )
        out.append(end)
        return out

    # ---- plots -----------------------------------------------------------
    def lost_object(self) -> list[str]:
        h = self.hero()
        thing = self.thing()
        helper, hpro = self.pick(HELPERS)
        s = self.opening(h)
        s.append(f"{h.name} had {article(thing)} that {h.subj} loved very much.")
        s.append(
            self.pick(
                [
                    f"But one day, the {thing} was gone!",
                    f"One morning, {h.name} could not find the {thing}.",
                    f"Then {h.subj} looked around, and the {thing} was not there.",
                ]
            )
        )
        s.append(
            self.said(
                h.name,
                self.pick(
                    [
                        f"Where is my {thing}?",
                        "Oh no, where did it go?",
                        f"Has anyone seen my {thing}?",
                    ]
                ),
            )
        )
        spots = self.r.sample(SPOTS, 3)
        s.append(cap(f"{h.subj} looked {spots[0]} and {spots[1]}, but it was not there."))
        s.append(cap(f"{h.name} felt {self.pick(BAD_FEELINGS)}."))
        s.append(cap(f"then {helper} came by."))
        s.append(
            self.said(
                helper,
                self.pick(
                    ["Why are you sad?", "What is wrong, little one?", "Can I help you look?"]
                ),
            )
        )
        s.append(
            cap(
                f"{h.name} told {'it' if hpro == 'it' else ('her' if hpro == 'she' else 'him')} "
                f"about the {thing}."
            )
        )
        s.append(cap(f"together they looked {spots[2]}, and there it was!"))
        s.append(self.said(h.name, self.pick(["Thank you so much!", "I found it!", "Hooray!"])))
        s.append(cap(f"{h.subj} held the {thing} close and felt {self.pick(GOOD_FEELINGS)}."))
        return s + self.ending(h, plot="lost_object")

    def new_friend(self) -> list[str]:
        h = self.hero()
        f = self.hero(exclude=h.name)
        place, goto = self.pick(PLACES)
        act_base, act_past = self.pick(ACTIVITIES)
        s = self.opening(h)
        s.append(cap(f"{h.subj} {self.pick(MOVES)} {goto}, but {h.subj} had no one to play with."))
        s.append(cap(f"{h.name} felt {self.pick(['lonely', 'sad', 'bored'])}."))
        s.append(f"Then {h.subj} saw {f.desc}.")
        s.append(
            self.said(
                h.name,
                self.pick(
                    [
                        "Hello! Do you want to play with me?",
                        "Hi! What is your name?",
                        f"Would you like to {act_base} with me?",
                    ]
                ),
            )
        )
        s.append(
            self.said(
                f.name,
                self.pick(
                    [
                        "Yes, I would love to!",
                        f"My name is {f.name}. Let's play!",
                        "Okay, that sounds fun!",
                    ]
                ),
            )
        )
        s.append(cap(f"so {h.name} and {f.name} {act_past} together."))
        act2 = self.pick(ACTIVITIES)[1]
        s.append(
            self.pick(
                [
                    f"Then they {act2} until the sun went down.",
                    f"After that, they {act2} and laughed a lot.",
                    f"Later, they {act2} by {place}.",
                ]
            )
        )
        s.append(
            self.said(
                f.name,
                self.pick(
                    [
                        "Can we play again tomorrow?",
                        "You are my new best friend!",
                        "This was so much fun!",
                    ]
                ),
            )
        )
        s.append(self.said(h.name, self.pick(["Yes, of course!", "See you tomorrow!", "Me too!"])))
        return s + self.ending(h, place, plot="new_friend")

    def fear(self) -> list[str]:
        h = self.hero()
        what, truth = self.pick(FEARS)
        helper, _ = self.pick(HELPERS)
        s = self.opening(h)
        s.append(cap(f"{h.name} was afraid of {what}."))
        s.append(
            self.said(
                h.name,
                self.pick(
                    [
                        f"I do not like {what}.",
                        f"I am too scared of {what}.",
                        f"What if {what} is scary?",
                    ]
                ),
            )
        )
        s.append(cap(f"{helper} sat down next to {h.obj}."))
        s.append(
            self.said(
                helper,
                self.pick(
                    [
                        "It is okay to be scared. I will stay with you.",
                        "Let's try together, one small step at a time.",
                        "You are braver than you think.",
                    ]
                ),
            )
        )
        s.append(cap(f"{h.name} took a deep breath and tried."))
        s.append(cap(f"soon {h.subj} saw that {truth}."))
        s.append(
            self.said(
                h.name,
                self.pick(
                    ["That was not so scary after all!", "I did it!", "I am not afraid anymore!"]
                ),
            )
        )
        s.append(cap(f"{h.subj} felt very {self.pick(['proud', 'brave', 'happy'])}."))
        return s + self.ending(h, plot="fear")

    def sharing(self) -> list[str]:
        h = self.hero()
        f = self.hero(exclude=h.name)
        food = self.pick(FOODS)
        n = self.pick(["two", "three", "four", "five", "six"])
        plural = (
            food + ("es" if food.endswith(("ch", "sh")) else "s")
            if not food.endswith(
                ("cheese", "honey", "jam", "bread", "soup", "pizza", "popcorn", "corn")
            )
            else food
        )
        s = self.opening(h)
        if plural != food:
            s.append(cap(f"{h.subj} had {n} {plural} in {h.poss} basket."))
        else:
            s.append(cap(f"{h.subj} had some {food} in {h.poss} basket."))
        s.append(f"On the way, {h.subj} met {f.desc}.")
        s.append(cap(f"{f.name} looked {self.pick(['hungry', 'sad', 'tired', 'lonely'])}."))
        s.append(
            self.said(
                h.name, self.pick(["Are you okay?", "What is the matter?", "Are you hungry?"])
            )
        )
        s.append(
            self.said(
                f.name,
                self.pick(
                    [
                        "I have nothing to eat today.",
                        "I forgot my lunch at home.",
                        "My tummy is rumbling.",
                    ]
                ),
            )
        )
        s.append(cap(f"{h.name} thought for a moment."))
        s.append(
            self.said(
                h.name,
                self.pick(
                    [
                        "Here, you can have some of mine.",
                        "Let's share!",
                        f"Would you like some {food}?",
                    ]
                ),
            )
        )
        s.append(
            self.pick(
                [
                    "They sat together and ate.",
                    "They shared the food under a big tree.",
                    "They ate together and talked about their day.",
                ]
            )
        )
        s.append(cap(f"{f.name} smiled and said thank you."))
        return s + self.ending(h, plot="sharing")

    def adventure(self) -> list[str]:
        h = self.hero()
        place, goto = self.pick(PLACES)
        s = self.opening(h)
        s.append(
            cap(f"{h.subj} wanted to go on an adventure, so {h.subj} {self.pick(MOVES)} {goto}.")
        )
        seen = [
            f"{self.pick(COLOR_ADJ)} {self.pick(OBJECTS)}",
            f"{self.pick(SIZE_ADJ)} {self.pick(ANIMALS)[0]}",
            f"{self.pick(THING_ADJ)} {self.pick(OBJECTS)}",
        ]
        s.append(
            f"At {place}, {h.subj} saw {article(seen[0])}, {article(seen[1])} and "
            f"{article(seen[2])}."
        )
        animal, sound = self.pick(ANIMALS)
        s.append(f"{cap(article(animal))} {sound} nearby.")
        s.append(
            self.said(
                h.name,
                self.pick(
                    ["What a wonderful place!", f"I love {place}!", "Look at all these things!"]
                ),
            )
        )
        s.append(
            self.pick(
                [
                    "Then the sky grew dark, and it started to rain.",
                    "Then the sun began to set.",
                    "Then a strong wind began to blow.",
                    "After a while, it was time for lunch.",
                ]
            )
        )
        s.append(cap(f"{h.subj} {self.pick(MOVES)} back home."))
        fam = self.pick(FAMILY)
        s.append(cap(f"{h.poss} {fam} was waiting at the door."))
        s.append(
            self.said(
                f"{h.poss} {fam}",
                self.pick(["Where have you been?", "Did you have fun?", "Tell me everything!"]),
            )
        )
        s.append(cap(f"{h.name} told {h.poss} {fam} about the {seen[0]} and the {seen[1]}."))
        return s + self.ending(h, place, plot="adventure")

    def learning(self) -> list[str]:
        h = self.hero()
        skill, success, failure = self.pick(SKILLS)
        helper, _ = self.pick(HELPERS)
        s = self.opening(h)
        s.append(cap(f"{h.name} wanted to learn how to {skill}."))
        s.append(cap(f"the first time {h.subj} tried, {h.subj} {failure}."))
        s.append(cap(f"{h.subj} felt {self.pick(['sad', 'upset', 'grumpy'])}."))
        s.append(
            self.said(
                h.name, self.pick(["I can't do it!", "This is too hard!", "I will never learn!"])
            )
        )
        s.append(
            self.said(
                helper,
                self.pick(
                    [
                        "Everyone falls at first. Try again!",
                        "Keep practicing, and you will get better.",
                        "Do not give up. You can do it!",
                    ]
                ),
            )
        )
        s.append(cap(f"so {h.name} tried again, and again, and again."))
        s.append(cap(f"at last, {h.subj} {success}!"))
        s.append(self.said(h.name, self.pick(["I did it!", "Look at me!", "Hooray, I can do it!"])))
        return s + self.ending(h, plot="learning")

    def birthday(self) -> list[str]:
        h = self.hero()
        f = self.hero(exclude=h.name)
        gift = self.thing()
        s = self.opening(h)
        s.append(f"It was the birthday of {h.poss} friend {f.name}.")
        s.append(cap(f"{h.name} wanted to give {f.name} a special present."))
        s.append(
            self.pick(
                [
                    f"{cap(h.subj)} made {article(gift)} all by {h.obj}self.",
                    f"{cap(h.subj)} saved {h.poss} coins and bought {article(gift)}.",
                    f"{cap(h.subj)} found {article(gift)} and wrapped it in "
                    f"{self.pick(COLOR_ADJ)} paper.",
                ]
            )
        )
        candles = self.pick(["five", "six", "seven", "eight"])
        s.append(f"At the party, there was a big cake with {candles} candles.")
        s.append(self.said(h.name, f"Happy birthday, {f.name}! This is for you."))
        s.append(cap(f"{f.name} opened the present and saw the {gift}."))
        s.append(
            self.said(
                f.name,
                self.pick(
                    ["I love it! Thank you!", "It is perfect!", "This is the best present ever!"]
                ),
            )
        )
        s.append(f"Everyone sang and ate cake, and they {self.pick(ACTIVITIES)[1]} after.")
        return s + self.ending(h, plot="birthday")

    def helping(self) -> list[str]:
        h = self.hero()
        problem, action, result = self.pick(PROBLEMS)
        s = self.opening(h)
        s.append(cap(f"{h.subj} {self.pick(MOVES)} {self.pick(PLACES)[1]}."))
        s.append(cap(f"there, {h.subj} saw that {problem}."))
        s.append(
            self.said(
                h.name,
                self.pick(["I can help!", "Don't worry, I have an idea.", "Let me try to help."]),
            )
        )
        s.append(cap(f"{h.name} {action}."))
        s.append(cap(f"soon {result}."))
        s.append(
            self.pick(
                [
                    "Everyone cheered.",
                    "Everyone clapped and smiled.",
                    f"Everyone said {h.name} was very clever.",
                ]
            )
        )
        s.append(cap(f"{h.name} felt {self.pick(GOOD_FEELINGS)} because {h.subj} had helped."))
        return s + self.ending(h, plot="helping")

    def turns(self) -> list[str]:
        h = self.hero()
        f = self.hero(exclude=h.name)
        toy = self.thing()
        s = self.opening(h)
        s.append(cap(f"{h.name} and {f.name} were playing together."))
        s.append(cap(f"they both wanted the {toy} at the same time."))
        s.append(
            self.said(
                h.name,
                self.pick([f"It is my turn with the {toy}!", "I had it first!", "Give it to me!"]),
            )
        )
        s.append(
            self.said(
                f.name, self.pick(["No, it is mine!", "But I want it too!", "That is not fair!"])
            )
        )
        s.append(
            cap(f"they pulled and pulled, and both felt {self.pick(['angry', 'upset', 'grumpy'])}.")
        )
        s.append(cap(f"then {h.name} stopped and had an idea."))
        s.append(
            self.said(
                h.name,
                self.pick(
                    [
                        "I am sorry. Let's take turns.",
                        "You can go first, and then it is my turn.",
                        "Let's play with it together.",
                    ]
                ),
            )
        )
        s.append(
            self.said(
                f.name,
                self.pick(
                    ["Okay! I am sorry too.", "That is a good idea!", "Thank you, that is fair."]
                ),
            )
        )
        s.append(cap(f"they took turns with the {toy} and had lots of fun."))
        return s + self.ending(h, plot="turns")

    def day(self) -> list[str]:
        h = self.hero()
        acts = self.r.sample(ACTIVITIES, 3)
        food = self.pick(FOODS)
        s = self.opening(h)
        s.append(cap(f"in the morning, {h.subj} ate {article(food)} for breakfast."))
        s.append(cap(f"then {h.subj} {self.pick(MOVES)} {self.pick(PLACES)[1]} and {acts[0][1]}."))
        s.append(cap(f"after lunch, {h.name} {acts[1][1]} with {h.poss} {self.pick(FAMILY)}."))
        s.append(cap(f"in the evening, they {acts[2][1]}."))
        s.append(
            self.said(
                h.name,
                self.pick(
                    [
                        "What a lovely day!",
                        "Can we do this again tomorrow?",
                        "I am so tired, but happy.",
                    ]
                ),
            )
        )
        return s + self.ending(h, plot="day")

    PLOTS = (
        "lost_object",
        "new_friend",
        "fear",
        "sharing",
        "adventure",
        "learning",
        "birthday",
        "helping",
        "turns",
        "day",
    )

    def story(self, plot: str | None = None) -> tuple[str, str]:
        """Return (plot name, story text); long stories are split into two paragraphs."""
        plot = plot or self.pick(self.PLOTS)
        sentences = getattr(self, plot)()
        if len(sentences) > 8 and self.r.random() < 0.5:
            cut = len(sentences) // 2
            text = " ".join(sentences[:cut]) + "\n\n" + " ".join(sentences[cut:])
        else:
            text = " ".join(sentences)
        return plot, text


THEME = {
    "lost_object": "losing something",
    "new_friend": "making a new friend",
    "fear": "being brave",
    "sharing": "sharing",
    "adventure": "an adventure",
    "learning": "learning something new",
    "birthday": "a birthday",
    "helping": "helping others",
    "turns": "taking turns",
    "day": "a happy day",
}

REQUESTS = [
    "Tell me a story about {theme}.",
    "Can you write a short story about {theme}?",
    "Please tell me a bedtime story.",
    "Write a story for a child.",
    "Tell me a story.",
    "I would like a story about {theme}.",
    "Can you tell me a happy story?",
    "Write a short story about {theme}, please.",
    "Tell me a story about {a_kind}.",
    "Write a story about {name}.",
    "Can you tell me a story about {a_kind} named {name}?",
    "A story about {a_kind}, please.",
    # Bare story openings and topics, as a user types them at a prompt.
    "Once upon a time",
    "The little {kind}",
    "One day",
    "{name} the {kind}",
    "{a_kind}",
    "A story about {theme}",
    "Tell me about {name}.",
]
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a friendly storyteller for children.",
    "You tell short, kind stories.",
]


def generate_stories(n: int, seed: int = 0) -> list[str]:
    """Return `n` plain stories, deterministic for `seed`."""
    w = StoryWriter(random.Random(seed))
    return [w.story()[1] for _ in range(n)]


def generate_chats(n: int, seed: int = 1) -> list[list[dict[str, str]]]:
    """Return `n` chat conversations (system?, user request, assistant story)."""
    r = random.Random(seed)
    w = StoryWriter(r)
    chats = []
    for _ in range(n):
        plot, text = w.story()
        msgs = []
        if r.random() < 0.4:
            msgs.append({"role": "system", "content": r.choice(SYSTEMS)})
        h = w.main
        request = r.choice(REQUESTS).format(
            theme=THEME[plot], kind=h.kind, a_kind=article(h.kind), name=h.name
        )
        msgs.append({"role": "user", "content": cap(request)})
        msgs.append({"role": "assistant", "content": text})
        chats.append(msgs)
    return chats


if __name__ == "__main__":
    for story in generate_stories(3, seed=42):
        print(story, end="\n\n---\n\n")
