// Which part of the KV pool the block map draws. `minipaged serve`'s default pool is 1,456 blocks: drawn whole,
// a few requests filled two rows of an otherwise empty grid, and a projector showed almost nothing. The map draws
// a window of the pool instead ("blocks 256-511 of 1,456") that holds every block in use: one block a cell while
// they fit, 2, 4, 8 ... blocks a cell when they spread wider. The block manager hands out blocks from the front
// of its free queue and puts freed ones at the back, so the blocks in use march through the pool; the window
// follows them, and stays put while it still holds them, so the map does not jump at every step.

export const ALIGN_CELLS = 32;          // a window starts at a multiple of this many cells: round block numbers

/**
 * The window: `{start, group, count}`, `count` cells of `group` blocks each from block `start`.
 * @param {number} numBlocks the pool's size
 * @param {number|null} lo the lowest block in use (null: none is)
 * @param {number|null} hi the highest block in use
 * @param {number} cells the most cells the map draws
 * @param {{start: number, group: number, count: number}|null} current the window drawn now, kept if it still fits
 */
export function mapWindow(numBlocks, lo, hi, cells, current = null) {
  if (numBlocks <= cells) return { start: 0, group: 1, count: numBlocks };
  if (lo === null || lo === undefined) {
    return current && current.count <= cells ? current : { start: 0, group: 1, count: cells };
  }
  let best = null;
  for (let group = 1; !best; group *= 2) {
    const span = group * cells;
    if (span >= numBlocks) {
      best = { start: 0, group, count: Math.ceil(numBlocks / group) };
    } else {
      const align = ALIGN_CELLS * group;
      const start = Math.min(Math.floor(lo / align) * align, numBlocks - span);
      if (hi < start + span) best = { start, group, count: cells };
    }
  }
  const holds = (w) => w.start <= lo && hi < w.start + w.group * w.count;
  if (current && current.group === best.group && current.count === best.count && holds(current)) return current;
  return best;
}

/** The lowest and the highest block with an owner ([null, null] when none has one). */
export function blocksInUse(blockOwners) {
  let lo = null, hi = null;
  blockOwners.forEach((owners, b) => {
    if (owners.length) { if (lo === null) lo = b; hi = b; }
  });
  return [lo, hi];
}
