"""Math prompts: grade-school word problems from registered templates, each returning a prompt and its exact
answer, with names, objects and items drawn from the word lists here."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from fractions import Fraction

from .splits import SPLITS, heldout_sources, make_record, seeded_rng

FIRST_NAMES = (
    "Aiden", "Amara", "Ava", "Ben", "Bianca", "Bruno", "Camila", "Carlos", "Chloe", "Daniel", "Dev", "Divya",
    "Elena", "Emil", "Eva", "Fatima", "Felix", "Finn", "Gabriel", "Gita", "Grace", "Hana", "Hiro", "Hugo", "Ines",
    "Isla", "Ivan", "Jamal", "Jonah", "Julia", "Kai", "Kenji", "Layla", "Lena", "Marco", "Mateo", "Nadia", "Noor",
    "Omar", "Oscar", "Paula", "Priya", "Quinn", "Rahul", "Rosa", "Samir", "Sofia", "Tara", "Tomas", "Uma", "Umar",
    "Vera", "Victor", "Wanda", "Wei", "Ximena", "Yara", "Yusuf", "Zane", "Zoe",
)
_OBJECTS = ("apples", "marbles", "stickers", "pencils", "books", "cookies", "stamps", "seashells", "trading cards",
            "balloons", "coins", "toy cars", "oranges", "crayons", "buttons", "beads", "eggs", "cupcakes",
            "postcards", "strawberries")
_ITEMS = (("notebook", "notebooks"), ("pen", "pens"), ("sandwich", "sandwiches"), ("movie ticket", "movie tickets"),
          ("box of crayons", "boxes of crayons"), ("bottle of juice", "bottles of juice"), ("bus pass", "bus passes"),
          ("plant pot", "plant pots"), ("comic book", "comic books"), ("bag of rice", "bags of rice"),
          ("scarf", "scarves"), ("puzzle", "puzzles"), ("mug", "mugs"), ("kite", "kites"))
_CONTAINERS = ("boxes", "bags", "crates", "jars", "baskets", "trays")

MathTemplate = Callable[[random.Random, Sequence[str]], tuple[str, str]]
MATH_TEMPLATES: dict[str, MathTemplate] = {}
HELDOUT_MATH_TEMPLATES = frozenset({"buses_meeting", "consecutive_integers", "equal_baskets", "marble_probability",
                                    "median_of_list", "temperature_conversion", "work_together"})


def _math(name: str) -> Callable[[MathTemplate], MathTemplate]:
    def register(fn: MathTemplate) -> MathTemplate:
        MATH_TEMPLATES[name] = fn
        return fn
    return register


def _num(value: Fraction | int) -> str:
    """Exact rendering: an integer, a terminating decimal, or a fraction ``p/q``."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    for places in range(1, 5):
        scaled = value * 10 ** places
        if scaled.denominator == 1:
            return f"{value.numerator / value.denominator:.{places}f}"
    return f"{value.numerator}/{value.denominator}"


def _money(value: Fraction | int) -> str:
    value = Fraction(value)
    return f"${value.numerator}" if value.denominator == 1 else f"${float(value):.2f}"


@_math("add_items")
def _add_items(rng, names):
    a, b = rng.sample(names, 2)
    obj, x, y = rng.choice(_OBJECTS), rng.randint(3, 80), rng.randint(2, 60)
    return rng.choice((
        f"{a} has {x} {obj}. {b} gives {a} {y} more. How many {obj} does {a} have now?",
        f"{a} collected {x} {obj} on Monday and {y} {obj} on Tuesday. How many {obj} did {a} collect in total?",
        f"There are {x} {obj} in a basket. {a} puts in {y} more. How many {obj} are in the basket now?",
    )), str(x + y)


@_math("take_away")
def _take_away(rng, names):
    a, b = rng.sample(names, 2)
    obj, x = rng.choice(_OBJECTS), rng.randint(20, 120)
    y = rng.randint(1, x - 1)
    return rng.choice((
        f"{a} had {x} {obj} and gave {y} of them to {b}. How many {obj} does {a} have left?",
        f"A jar held {x} {obj}. {a} took out {y}. How many {obj} are still in the jar?",
        f"{a} started the day with {x} {obj} and lost {y}. How many are left?",
    )), str(x - y)


@_math("equal_groups")
def _equal_groups(rng, names):
    a = rng.choice(names)
    obj, box, n, k = rng.choice(_OBJECTS), rng.choice(_CONTAINERS), rng.randint(2, 15), rng.randint(2, 24)
    return rng.choice((
        f"There are {n} {box} with {k} {obj} in each. How many {obj} are there in total?",
        f"{a} fills {n} {box}, putting {k} {obj} in every one. How many {obj} does {a} use?",
        f"Each of {n} {box} holds {k} {obj}. What is the total number of {obj}?",
    )), str(n * k)


@_math("share_equally")
def _share_equally(rng, names):
    a = rng.choice(names)
    obj, people, each = rng.choice(_OBJECTS), rng.randint(2, 12), rng.randint(2, 20)
    total = people * each
    return rng.choice((
        f"{a} shares {total} {obj} equally among {people} friends. How many {obj} does each friend get?",
        f"{total} {obj} are split evenly into {people} groups. How many {obj} are in each group?",
        f"A teacher hands out {total} {obj} so that each of {people} students gets the same number. How many does "
        f"each student get?",
    )), str(each)


@_math("bags_with_remainder")
def _bags_with_remainder(rng, names):
    a = rng.choice(names)
    obj, size = rng.choice(_OBJECTS), rng.randint(3, 12)
    total = size * rng.randint(2, 20) + rng.randint(1, size - 1)
    full, left = divmod(total, size)
    return rng.choice((
        f"{a} packs {total} {obj} into bags of {size}. How many full bags are there, and how many {obj} are left "
        f"over?",
        f"There are {total} {obj}. If each box holds {size}, how many boxes can be filled completely and how many "
        f"{obj} remain?",
    )), f"{full} full, {left} left over"


@_math("order_of_operations")
def _order_of_operations(rng, names):
    a, b, c, d = (rng.randint(2, 30) for _ in range(4))
    form = rng.randrange(3)
    if form == 0:
        expr, value = f"{a} + {b} × {c} - {d}", a + b * c - d
    elif form == 1:
        expr, value = f"({a} + {b}) × {c} - {d}", (a + b) * c - d
    else:
        expr, value = f"{a} × {b} - {c} × {d}", a * b - c * d
    return rng.choice((f"Compute {expr}.", f"What is the value of {expr}?",
                       f"Evaluate {expr}, showing the order of operations.")), str(value)


@_math("multiply_numbers")
def _multiply_numbers(rng, names):
    a, b = rng.randint(12, 99), rng.randint(3, 99)
    return rng.choice((f"What is {a} × {b}?", f"Multiply {a} by {b}.", f"Calculate {a} times {b}.")), str(a * b)


@_math("add_large_numbers")
def _add_large_numbers(rng, names):
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    return rng.choice((f"What is {a} + {b}?", f"Add {a} and {b}.",
                       f"Find the sum of {a} and {b}.")), str(a + b)


@_math("subtract_large_numbers")
def _subtract_large_numbers(rng, names):
    a = rng.randint(500, 9999)
    b = rng.randint(100, a - 1)
    return rng.choice((f"What is {a} - {b}?", f"Subtract {b} from {a}.",
                       f"Find the difference between {a} and {b}.")), str(a - b)


_LENGTH_UNITS = (("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("centimeters", "millimeters", 10),
                 ("meters", "millimeters", 1000))


@_math("convert_length")
def _convert_length(rng, names):
    big, small, factor = rng.choice(_LENGTH_UNITS)
    x = rng.randint(2, 95)
    if rng.random() < 0.5:
        return rng.choice((f"How many {small} are in {x} {big}?", f"Convert {x} {big} to {small}.")), str(x * factor)
    return rng.choice((f"Convert {x * factor} {small} to {big}.",
                       f"How many {big} is {x * factor} {small}?")), str(x)


@_math("convert_mass")
def _convert_mass(rng, names):
    a, x = rng.choice(names), rng.randint(2, 60)
    if rng.random() < 0.5:
        return rng.choice((f"How many grams are in {x} kilograms?",
                           f"{a} buys {x} kilograms of flour. How many grams is that?")), str(x * 1000)
    grams = x * 250
    return rng.choice((f"Convert {grams} grams to kilograms.",
                       f"A parcel weighs {grams} grams. What is its weight in kilograms?")), _num(Fraction(grams, 1000))


@_math("convert_time")
def _convert_time(rng, names):
    a = rng.choice(names)
    form = rng.randrange(3)
    if form == 0:
        h = rng.randint(2, 30)
        return rng.choice((f"How many minutes are in {h} hours?",
                           f"{a} practiced piano for {h} hours this month. How many minutes is that?")), str(h * 60)
    if form == 1:
        m = rng.randint(2, 90)
        return rng.choice((f"How many seconds are in {m} minutes?", f"Convert {m} minutes to seconds.")), str(m * 60)
    d = rng.randint(2, 40)
    return rng.choice((f"How many hours are in {d} days?", f"Convert {d} days to hours.")), str(d * 24)


@_math("convert_volume")
def _convert_volume(rng, names):
    a, x = rng.choice(names), rng.randint(2, 40)
    if rng.random() < 0.5:
        return rng.choice((f"How many milliliters are in {x} liters?",
                           f"{a} drinks {x} liters of water over a week. How many milliliters is that?")), str(x * 1000)
    ml = x * 500
    return rng.choice((f"Convert {ml} milliliters to liters.",
                       f"A tank holds {ml} milliliters. How many liters is that?")), _num(Fraction(ml, 1000))


@_math("percent_of")
def _percent_of(rng, names):
    p, n = 5 * rng.randint(1, 19), 20 * rng.randint(1, 40)
    return rng.choice((f"What is {p}% of {n}?", f"Calculate {p}% of {n}.",
                       f"Find {p}% of {n}.")), _num(Fraction(p * n, 100))


@_math("sale_price")
def _sale_price(rng, names):
    a = rng.choice(names)
    item = rng.choice(_ITEMS)[0]
    price, p = 20 * rng.randint(1, 25), 5 * rng.randint(1, 15)
    sale = Fraction(price * (100 - p), 100)
    return rng.choice((
        f"A {item} costs ${price}. It is on sale for {p}% off. What is the sale price?",
        f"{a} wants a {item} that normally costs ${price}. The store takes {p}% off. How much does {a} pay?",
        f"The price of a {item} is ${price}, and there is a {p}% discount. What is the discounted price?",
    )), _money(sale)


@_math("percent_increase")
def _percent_increase(rng, names):
    base, p = 100 * rng.randint(2, 90), rng.choice((2, 4, 5, 10, 12, 15, 20, 25, 30, 40, 50))
    new = Fraction(base * (100 + p), 100)
    return rng.choice((
        f"A town had {base} residents. The population grew by {p}%. How many residents does it have now?",
        f"A company made {base} bicycles last year and plans to make {p}% more this year. How many bicycles is "
        f"that?",
        f"A library had {base} books and increased its collection by {p}%. How many books does it have now?",
    )), _num(new)


@_math("percent_of_total")
def _percent_of_total(rng, names):
    total = rng.choice((20, 25, 40, 50, 80, 100, 200, 400, 500))
    part = rng.randint(1, total - 1)
    while (part * 100) % total:
        part = rng.randint(1, total - 1)
    return rng.choice((
        f"{part} out of {total} students passed the test. What percent passed?",
        f"In a survey of {total} people, {part} said they like tea best. What percentage is that?",
        f"A team won {part} of its {total} games. What percent of its games did it win?",
    )), f"{part * 100 // total}%"


@_math("linear_equation")
def _linear_equation(rng, names):
    a, x, b = rng.randint(2, 12), rng.randint(1, 25), rng.randint(1, 50)
    c = a * x + b
    return rng.choice((f"Solve for x: {a}x + {b} = {c}", f"Solve {a}x + {b} = {c}.",
                       f"Find x if {a}x + {b} = {c}.")), f"x = {x}"


@_math("two_sided_equation")
def _two_sided_equation(rng, names):
    a, c = rng.sample(range(2, 13), 2)
    if a < c:
        a, c = c, a
    x, b = rng.randint(1, 20), rng.randint(0, 40)
    d = (a - c) * x + b
    return rng.choice((f"Solve for x: {a}x + {b} = {c}x + {d}", f"Find the value of x in {a}x + {b} = {c}x + {d}."
                       )), f"x = {x}"


@_math("system_of_equations")
def _system_of_equations(rng, names):
    x, y = rng.randint(1, 40), rng.randint(1, 40)
    if x < y:
        x, y = y, x
    return rng.choice((
        f"Solve the system: x + y = {x + y} and x - y = {x - y}.",
        f"Two numbers add up to {x + y}, and their difference is {x - y}. What are the numbers?",
    )), f"x = {x}, y = {y}"


@_math("age_difference")
def _age_difference(rng, names):
    a, b = rng.sample(names, 2)
    young, gap = rng.randint(3, 40), rng.randint(1, 30)
    return rng.choice((
        f"{a} is {gap} years older than {b}. Together their ages add up to {2 * young + gap}. How old is each of "
        f"them?",
        f"The sum of {a}'s and {b}'s ages is {2 * young + gap}. {a} is {gap} years older. Find both ages.",
    )), f"{a} is {young + gap}, {b} is {young}"


@_math("age_in_future")
def _age_in_future(rng, names):
    a, b = rng.sample(names, 2)
    young, times, later = rng.randint(2, 15), rng.randint(2, 4), rng.randint(1, 20)
    return rng.choice((
        f"{a} is {times} times as old as {b}. {b} is {young} years old. How old will {a} be in {later} years?",
        f"{b} is {young}. {a}'s age is {times} times {b}'s age. What will {a}'s age be {later} years from now?",
    )), str(times * young + later)


@_math("change_from_purchase")
def _change_from_purchase(rng, names):
    a = rng.choice(names)
    single, plural = rng.choice(_ITEMS)
    n, cents = rng.randint(2, 6), 25 * rng.randint(4, 40)
    cost = Fraction(n * cents, 100)
    bill = next(b for b in (5, 10, 20, 50, 100) if b > cost)
    return rng.choice((
        f"{a} buys {n} {plural} at {_money(Fraction(cents, 100))} each and pays with a ${bill} bill. How much change "
        f"does {a} get?",
        f"One {single} costs {_money(Fraction(cents, 100))}. If {a} pays for {n} of them with ${bill}, what is the "
        f"change?",
    )), _money(bill - cost)


@_math("weeks_to_save")
def _weeks_to_save(rng, names):
    a = rng.choice(names)
    item = rng.choice(_ITEMS)[0]
    per_week, weeks = rng.randint(3, 40), rng.randint(2, 30)
    return rng.choice((
        f"{a} saves ${per_week} every week. How many weeks will it take to save ${per_week * weeks}?",
        f"A {item} costs ${per_week * weeks}. If {a} puts aside ${per_week} a week, how many weeks until {a} can buy "
        f"it?",
    )), str(weeks)


@_math("shopping_total")
def _shopping_total(rng, names):
    a = rng.choice(names)
    (_, p1), (_, p2) = rng.sample(_ITEMS, 2)
    n, m, x, y = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 15), rng.randint(1, 15)
    return rng.choice((
        f"{a} buys {n} {p1} at ${x} each and {m} {p2} at ${y} each. How much does {a} spend in total?",
        f"What is the total cost of {n} {p1} at ${x} each plus {m} {p2} at ${y} each?",
    )), _money(n * x + m * y)


@_math("distance_from_speed")
def _distance_from_speed(rng, names):
    a = rng.choice(names)
    v, t = 5 * rng.randint(2, 24), rng.randint(2, 9)
    return rng.choice((
        f"A car travels at {v} km/h for {t} hours. How far does it go?",
        f"{a} cycles at a steady {v} km/h for {t} hours. What distance does {a} cover?",
        f"A train moves at {v} kilometers per hour. How many kilometers does it travel in {t} hours?",
    )), f"{v * t} km"


@_math("travel_time")
def _travel_time(rng, names):
    a = rng.choice(names)
    v, t = 5 * rng.randint(2, 24), rng.randint(2, 9)
    return rng.choice((
        f"How long does it take to travel {v * t} km at {v} km/h?",
        f"{a} drives {v * t} kilometers at an average speed of {v} km/h. How many hours does the trip take?",
    )), f"{t} hours"


@_math("average_speed")
def _average_speed(rng, names):
    a = rng.choice(names)
    t1, t2, v = rng.randint(1, 5), rng.randint(1, 5), rng.randint(20, 90)
    d1 = rng.randint(1, v * (t1 + t2) - 1)
    d2 = v * (t1 + t2) - d1
    return rng.choice((
        f"{a} drives {d1} km in {t1} hours and then {d2} km in {t2} hours. What is the average speed for the whole "
        f"trip?",
        f"A bus covers {d1} km in {t1} hours and another {d2} km in {t2} hours. Find its average speed.",
    )), f"{v} km/h"


def _clock(minutes: int) -> str:
    hours, mins = divmod(minutes % (24 * 60), 60)
    suffix = "AM" if hours < 12 else "PM"
    return f"{(hours - 1) % 12 + 1}:{mins:02d} {suffix}"


@_math("clock_end_time")
def _clock_end_time(rng, names):
    a = rng.choice(names)
    start, length = 5 * rng.randint(84, 250), 5 * rng.randint(5, 40)
    hours, mins = divmod(length, 60)
    duration = f"{hours} hour{'s' if hours != 1 else ''} and {mins} minutes" if hours else f"{mins} minutes"
    return rng.choice((
        f"A movie starts at {_clock(start)} and lasts {duration}. What time does it end?",
        f"{a} starts studying at {_clock(start)} and studies for {duration}. When does {a} finish?",
        f"A train leaves at {_clock(start)} and the journey takes {duration}. What time does it arrive?",
    )), _clock(start + length)


@_math("rectangle_area")
def _rectangle_area(rng, names):
    length, width, unit = rng.randint(2, 40), rng.randint(2, 40), rng.choice(("meters", "centimeters", "feet"))
    return rng.choice((
        f"A rectangle is {length} {unit} long and {width} {unit} wide. What is its area?",
        f"What is the area of a rectangular garden measuring {length} {unit} by {width} {unit}?",
        f"A rug is {length} {unit} long and {width} {unit} wide. How much floor does it cover?",
    )), str(length * width)


@_math("rectangle_perimeter")
def _rectangle_perimeter(rng, names):
    a = rng.choice(names)
    length, width = rng.randint(2, 60), rng.randint(2, 60)
    return rng.choice((
        f"What is the perimeter of a rectangle that is {length} m long and {width} m wide?",
        f"{a} wants to put a fence around a rectangular yard {length} m by {width} m. How many meters of fence are "
        f"needed?",
    )), f"{2 * (length + width)} m"


@_math("square_from_perimeter")
def _square_from_perimeter(rng, names):
    side = rng.randint(2, 40)
    return rng.choice((
        f"A square has a perimeter of {4 * side} cm. What is its area?",
        f"The perimeter of a square tile is {4 * side} cm. Find the area of the tile.",
    )), f"{side * side} square cm"


@_math("triangle_area")
def _triangle_area(rng, names):
    base, height = rng.randint(2, 40), 2 * rng.randint(1, 20)
    return rng.choice((
        f"A triangle has a base of {base} cm and a height of {height} cm. What is its area?",
        f"Find the area of a triangle with base {base} cm and height {height} cm.",
    )), f"{base * height // 2} square cm"


@_math("average_scores")
def _average_scores(rng, names):
    a = rng.choice(names)
    count = rng.randint(3, 6)
    scores = [rng.randint(50, 100) for _ in range(count)]
    while sum(scores) % count:
        scores[-1] = rng.randint(50, 100)
    listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
    return rng.choice((
        f"{a}'s test scores are {listed}. What is the average score?",
        f"Find the mean of these numbers: {listed}.",
        f"A player scored {listed} points in recent games. What is the average number of points per game?",
    )), str(sum(scores) // count)


@_math("score_needed")
def _score_needed(rng, names):
    a = rng.choice(names)
    scores = [rng.randint(60, 95) for _ in range(3)]
    needed = rng.randint(60, 100)
    while (sum(scores) + needed) % 4:
        needed = rng.randint(60, 100)
    target = (sum(scores) + needed) // 4
    return rng.choice((
        f"{a} scored {scores[0]}, {scores[1]} and {scores[2]} on three tests. What score does {a} need on the fourth "
        f"test to average exactly {target}?",
        f"After three quizzes with scores {scores[0]}, {scores[1]} and {scores[2]}, what must the fourth score be for "
        f"an average of {target}?",
    )), str(needed)


@_math("ratio_split")
def _ratio_split(rng, names):
    a, b = rng.sample(names, 2)
    p, q, unit = rng.randint(1, 9), rng.randint(1, 9), rng.randint(2, 30)
    while math.gcd(p, q) != 1:
        q = rng.randint(1, 9)
    total = (p + q) * unit
    return rng.choice((
        f"{a} and {b} share ${total} in the ratio {p}:{q}. How much does each get?",
        f"Divide {total} marbles between {a} and {b} in the ratio {p}:{q}.",
    )), f"{a}: {p * unit}, {b}: {q * unit}"


@_math("recipe_scaling")
def _recipe_scaling(rng, names):
    a = rng.choice(names)
    cups, batch, factor = rng.randint(1, 6), rng.choice((6, 8, 10, 12, 20, 24)), rng.randint(2, 5)
    return rng.choice((
        f"A recipe uses {cups} cups of flour to make {batch} cookies. How many cups are needed for {batch * factor} "
        f"cookies?",
        f"{a} needs {cups} cups of sugar for {batch} muffins. How much sugar does {a} need for {batch * factor} "
        f"muffins?",
    )), str(cups * factor)


@_math("fraction_of_book")
def _fraction_of_book(rng, names):
    a = rng.choice(names)
    frac = Fraction(rng.randint(1, 7), 8) if rng.random() < 0.5 else Fraction(rng.randint(1, 4), 5)
    pages = frac.denominator * rng.randint(10, 60)
    read = frac * pages
    return rng.choice((
        f"{a} has read {frac} of a {pages}-page book. How many pages are left to read?",
        f"A book has {pages} pages. After reading {frac} of it, how many pages does {a} still have to read?",
    )), _num(pages - read)


@_math("number_sequence")
def _number_sequence(rng, names):
    start, step, length = rng.randint(1, 50), rng.randint(2, 15), rng.randint(4, 6)
    if rng.random() < 0.5:
        terms = [start + step * i for i in range(length + 1)]
    else:
        ratio = rng.randint(2, 3)
        terms = [rng.randint(1, 5) * ratio ** i for i in range(length + 1)]
        terms = [terms[0] * ratio ** i for i in range(length + 1)]
    shown = ", ".join(map(str, terms[:-1]))
    return rng.choice((f"What is the next number in the sequence {shown}, ...?",
                       f"Continue the pattern: {shown}, ...")), str(terms[-1])


@_math("simple_interest")
def _simple_interest(rng, names):
    a = rng.choice(names)
    principal, rate, years = 100 * rng.randint(5, 100), rng.randint(1, 8), rng.randint(1, 10)
    interest = Fraction(principal * rate * years, 100)
    return rng.choice((
        f"{a} deposits ${principal} at {rate}% simple interest per year. How much interest is earned after {years} "
        f"years?",
        f"How much simple interest does ${principal} earn in {years} years at an annual rate of {rate}%?",
    )), _money(interest)


@_math("unit_price")
def _unit_price(rng, names):
    a = rng.choice(names)
    single, plural = rng.choice(_ITEMS)
    n, price, m = rng.randint(2, 12), rng.randint(1, 20), rng.randint(2, 30)
    return rng.choice((
        f"A pack of {n} {plural} costs ${n * price}. How much would {m} {plural} cost at the same price?",
        f"{a} paid ${n * price} for {n} {plural}. At that rate, what do {m} {plural} cost?",
    )), _money(m * price)


@_math("squares_and_roots")
def _squares_and_roots(rng, names):
    n = rng.randint(2, 40)
    if rng.random() < 0.5:
        return rng.choice((f"What is {n} squared?", f"Compute {n}²."
                           )), str(n * n)
    return rng.choice((f"What is the square root of {n * n}?", f"Find √{n * n}.")), str(n)


@_math("hourly_wage")
def _hourly_wage(rng, names):
    a = rng.choice(names)
    rate, hours, days = rng.randint(9, 40), rng.randint(2, 10), rng.randint(2, 6)
    return rng.choice((
        f"{a} earns ${rate} an hour and works {hours} hours a day for {days} days. How much does {a} earn?",
        f"At ${rate} per hour, how much is earned for working {hours} hours on each of {days} days?",
    )), _money(rate * hours * days)


@_math("fence_posts")
def _fence_posts(rng, names):
    a = rng.choice(names)
    gap, sections = rng.randint(2, 6), rng.randint(3, 30)
    return rng.choice((
        f"{a} puts fence posts along a straight {gap * sections} m line, one every {gap} m, with a post at each end. "
        f"How many posts are needed?",
        f"Trees are planted every {gap} meters along a {gap * sections}-meter path, including both ends. How many "
        f"trees are planted?",
    )), str(sections + 1)


@_math("pages_per_day")
def _pages_per_day(rng, names):
    a = rng.choice(names)
    per_day, days = rng.randint(5, 40), rng.randint(3, 30)
    return rng.choice((
        f"{a} reads {per_day} pages a day. How many days will it take to finish a {per_day * days}-page book?",
        f"A {per_day * days}-page book is read at {per_day} pages per day. How many days does it take?",
    )), str(days)


@_math("money_left")
def _money_left(rng, names):
    a = rng.choice(names)
    start = rng.randint(20, 200)
    spent = [rng.randint(1, start // 3) for _ in range(2)]
    return rng.choice((
        f"{a} had ${start}, spent ${spent[0]} on lunch and ${spent[1]} on a book. How much money is left?",
        f"Starting with ${start}, {a} pays ${spent[0]} for a ticket and ${spent[1]} for snacks. How much remains?",
    )), _money(start - sum(spent))


@_math("work_together")
def _work_together(rng, names):
    a, b = rng.sample(names, 2)
    x, y = rng.choice(((3, 6), (4, 12), (6, 3), (2, 2), (10, 15), (12, 24), (20, 30), (4, 4), (6, 12), (5, 20),
                       (12, 4), (8, 24), (9, 18), (30, 15), (6, 6)))
    job = rng.choice(("paint a fence", "clean the house", "mow the lawn", "sort the mail", "build a shed"))
    together = Fraction(x * y, x + y)
    return rng.choice((
        f"{a} can {job} in {x} hours and {b} can do it in {y} hours. How long does it take them working together?",
        f"Working alone, {a} needs {x} hours to {job}, and {b} needs {y} hours. If they work together, how many "
        f"hours will it take?",
    )), f"{_num(together)} hours"


@_math("buses_meeting")
def _buses_meeting(rng, names):
    p, q = rng.sample((4, 5, 6, 8, 9, 10, 12, 14, 15, 16, 18, 20, 24, 25, 30, 35, 40, 45), 2)
    together = math.lcm(p, q)
    if rng.random() < 0.5:
        start = 60 * rng.randint(6, 10) + 5 * rng.randint(0, 11)
        return rng.choice((
            f"One bus leaves the station every {p} minutes and another every {q} minutes. Both leave at "
            f"{_clock(start)}. At what time do they next leave together?",
            f"Two trams depart every {p} and {q} minutes, and both departed at {_clock(start)}. When do they next "
            f"depart at the same time?",
        )), _clock(start + together)
    return rng.choice((
        f"Two lights blink every {p} and {q} seconds. They blink together now. After how many seconds will they next "
        f"blink together?",
        f"Two runners start together on a track. One completes a lap every {p} seconds and the other every {q} "
        f"seconds. After how many seconds are they both at the start line again?",
    )), f"{together} seconds"


@_math("equal_baskets")
def _equal_baskets(rng, names):
    a = rng.choice(names)
    g = rng.randint(2, 12)
    x, y = (g * k for k in rng.sample(range(2, 16), 2))
    most = math.gcd(x, y)
    return rng.choice((
        f"{a} has {x} apples and {y} oranges and wants to make identical fruit baskets with no fruit left over. "
        f"What is the greatest number of baskets {a} can make?",
        f"What is the largest number of identical gift bags that can be made from {x} pens and {y} pencils, using "
        f"every item?",
    )), str(most)


@_math("marble_probability")
def _marble_probability(rng, names):
    a = rng.choice(names)
    counts = {"red": rng.randint(1, 12), "blue": rng.randint(1, 12), "green": rng.randint(0, 8)}
    total = sum(counts.values())
    bag = ", ".join(f"{n} {c}" for c, n in counts.items() if n)
    color = rng.choice(("red", "blue"))
    return rng.choice((
        f"A bag contains marbles: {bag}. {a} picks one marble at random. What is the probability that it is "
        f"{color}?",
        f"If you draw one marble at random from a bag with these marbles: {bag}, what is the chance of getting a "
        f"{color} one?",
    )), str(Fraction(counts[color], total))


@_math("temperature_conversion")
def _temperature_conversion(rng, names):
    celsius = 5 * rng.randint(-8, 20)
    fahrenheit = celsius * 9 // 5 + 32
    if rng.random() < 0.5:
        prompt = rng.choice((f"Convert {celsius} °C to Fahrenheit.",
                             f"The temperature is {celsius} degrees Celsius. What is it in Fahrenheit?"))
        return prompt, f"{fahrenheit} °F"
    prompt = rng.choice((f"Convert {fahrenheit} °F to Celsius.",
                         f"A thermometer reads {fahrenheit} degrees Fahrenheit. What is that in Celsius?"))
    return prompt, f"{celsius} °C"


@_math("consecutive_integers")
def _consecutive_integers(rng, names):
    n, count = rng.randint(1, 200), rng.choice((2, 3, 4, 5))
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    total = sum(range(n, n + count))
    return rng.choice((
        f"The sum of {words[count]} consecutive integers is {total}. What are the integers?",
        f"Find {words[count]} consecutive whole numbers that add up to {total}.",
    )), ", ".join(str(i) for i in range(n, n + count))


@_math("median_of_list")
def _median_of_list(rng, names):
    a = rng.choice(names)
    values = [rng.randint(1, 99) for _ in range(rng.choice((5, 7, 9)))]
    listed = ", ".join(map(str, values))
    return rng.choice((
        f"Find the median of these numbers: {listed}.",
        f"{a} recorded the following daily temperatures: {listed}. What is the median?",
    )), str(sorted(values)[len(values) // 2])


_MAX_MATH_MISSES = 500


def _math_candidates(templates: Sequence[str], names: Sequence[str], count: int, seed: int,
                     split: str) -> list[dict]:
    """About ``1.25 * count / len(templates)`` distinct prompts per template; a template that repeats itself
    ``_MAX_MATH_MISSES`` times in a row has run out and gives fewer."""
    quota = math.ceil(1.25 * count / len(templates)) + 5
    out = []
    for name in templates:
        rng = seeded_rng(seed, "math", split, name)
        seen: set[str] = set()
        misses = 0
        while len(seen) < quota and misses < _MAX_MATH_MISSES:
            prompt, answer = MATH_TEMPLATES[name](rng, names)
            if prompt in seen:
                misses += 1
                continue
            misses = 0
            seen.add(prompt)
            out.append(make_record(name, name, prompt, answer))
    return out


def math_splits(seed: int, counts: dict[str, int]) -> dict[str, list[dict]]:
    held_names = heldout_sources(FIRST_NAMES, "math-names", fraction=0.2)
    out = {}
    for split in SPLITS:
        heldout = split == "heldout"
        templates = sorted(t for t in MATH_TEMPLATES if (t in HELDOUT_MATH_TEMPLATES) == heldout)
        names = [n for n in FIRST_NAMES if (n in held_names) == heldout]
        out[split] = _math_candidates(templates, names, counts[split], seed, split)
    return out
