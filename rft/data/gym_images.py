"""reasoning-gym grid tasks drawn as images (`data.format: reasoning_gym_image`): the entries of a reasoning-gym
dataset whose grid is in its metadata, the grid drawn with PIL as a PNG and the prompt rewritten to refer to the
image instead of spelling the grid out.

`data.path` names one of GRID_TASKS; `data.options`, the seed (held-out sets: another seed, as for `reasoning_gym`)
and `generated_tasks` are those of `reasoning_gym` sets (rft/data/gym_tasks.py). Each row is `gym_rows`' with the
prompt replaced and `images` added; the answer and `metadata["reasoning_gym"]` are unchanged, so the
`reasoning_gym` (last number: maze, largest_island) and `reasoning_gym_tagged` (an `<answer>` block: rotate_matrix,
shortest_path) rewards score a reply with the dataset's own `score_answer`. A drawing is a pure function of the
entry: the same seed gives the same image bytes (with the same Pillow).
"""
from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rft.data.gym_tasks import GymError, build_dataset, gym_rows
from rft.schema import Image

CELL = 16  # pixels per grid cell
WHITE, DARK, GREEN, RED, BLUE, LINE = (255, 255, 255), (40, 40, 40), (40, 170, 70), (210, 40, 40), (60, 110, 200), \
    (150, 150, 150)


@dataclass(frozen=True)
class GridTask:
    """How one dataset's entry becomes a picture and a prompt: `cells(metadata)` the grid as rows of (colour, text)
    cells, `prompt(metadata)` the question about the image."""
    cells: Callable[[dict[str, Any]], list[list[tuple[tuple[int, int, int], str]]]]
    prompt: Callable[[dict[str, Any]], str]


def _maze_cells(m: dict[str, Any]) -> list[list[tuple[tuple[int, int, int], str]]]:
    colours = {m["wall"]: DARK, m["path"]: WHITE, m["start"]: GREEN, m["goal"]: RED}
    return [[(colours[c], "") for c in row] for row in m["grid"]]


def _path_cells(m: dict[str, Any]) -> list[list[tuple[tuple[int, int, int], str]]]:
    colours = {"X": DARK, "O": WHITE, "*": GREEN, "#": RED}
    return [[(colours[c], "") for c in row] for row in m["matrix"]]


GRID_TASKS: dict[str, GridTask] = {
    "maze": GridTask(_maze_cells, lambda m: (
        f"The image shows a maze of {len(m['grid'])} x {len(m['grid'][0])} squares: dark squares are walls, white "
        "squares are passages, the green square is the start and the red square is the goal. Each step moves one "
        "square up, down, left or right through passages.\nWhat is the minimum number of steps to reach the goal?\n"
        "Give only the number of steps as your final answer, no other text or formatting.")),
    "largest_island": GridTask(lambda m: [[(GREEN if v else BLUE, "") for v in row] for row in m["grid"]], lambda m: (
        f"The image shows a {len(m['grid'])} x {len(m['grid'][0])} grid: green cells are land (1) and blue cells "
        "are water (0). An island is a group of land cells connected 4-directionally (horizontal or vertical); all "
        "four edges of the grid are surrounded by water. The area of an island is the number of its cells.\n"
        "What is the maximum area of an island in the grid? If there is no island, answer 0.")),
    "rotate_matrix": GridTask(lambda m: [[(WHITE, str(v)) for v in row] for row in m["matrix"]], lambda m: (
        f"The image shows a {m['n']} x {m['n']} matrix. Rotate it by {90 * m['num_rotations']} degrees clockwise.\n"
        "Write the rotated matrix as text: one row per line, the numbers of a row separated by spaces.")),
    "shortest_path": GridTask(_path_cells, lambda m: (
        f"The image shows a {len(m['matrix'])} x {len(m['matrix'][0])} grid: the green cell is your starting point, "
        "the red cell your destination, white cells are open and dark cells are blocked. Find the shortest path "
        "from the start to the destination, moving only through open cells, up, down, left or right.\n"
        "Write it as a sequence of directions, e.g. right right down down up left; if there is no path, write "
        "infeasible.")),
}


def draw_grid(cells: list[list[tuple[tuple[int, int, int], str]]]) -> Image:
    """The grid as a PNG: CELL x CELL pixels a cell, grey lines between cells, each cell's text centred in black."""
    from PIL import Image as PILImage  # heavy: PIL, only for image task sets
    from PIL import ImageDraw, ImageFont

    rows, cols = len(cells), max(len(row) for row in cells)
    picture = PILImage.new("RGB", (cols * CELL + 1, rows * CELL + 1), LINE)
    draw, font = ImageDraw.Draw(picture), ImageFont.load_default(size=CELL - 4)
    for r, row in enumerate(cells):
        for c, (colour, text) in enumerate(row):
            box = (c * CELL + 1, r * CELL + 1, (c + 1) * CELL - 1, (r + 1) * CELL - 1)
            draw.rectangle(box, fill=colour)
            if text:
                draw.text(((box[0] + box[2] + 1) / 2, (box[1] + box[3] + 1) / 2), text, fill=(0, 0, 0), font=font,
                          anchor="mm")
    out = io.BytesIO()
    picture.save(out, "PNG", optimize=True)
    return Image.of(out.getvalue(), "image/png")


def grid_task(name: str) -> GridTask:
    """The GridTask of dataset `name`; GymError (key `path`) when it is not one of GRID_TASKS."""
    if name not in GRID_TASKS:
        raise GymError(f"reasoning_gym_image draws the grids of {', '.join(GRID_TASKS)}; {name!r} is not one",
                       key="path")
    return GRID_TASKS[name]


def gym_image_rows(name: str, options: dict[str, Any], *, seed: int, size: int) -> list[dict[str, Any]]:
    """`gym_rows(name, ...)` with each entry's grid drawn (`images`) and the prompt about the image; GymError for a
    dataset that is not one of GRID_TASKS (key `path`) or options it does not take."""
    task, dataset = grid_task(name), build_dataset(name, options, seed=seed, size=size)
    rows = gym_rows(name, options, seed=seed, size=size)
    for row, entry in zip(rows, dataset, strict=True):
        metadata = entry["metadata"]
        row["prompt"], row["images"] = task.prompt(metadata), [draw_grid(task.cells(metadata))]
    return rows
