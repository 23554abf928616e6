import { describe, expect, it } from 'vitest';

import {
  chartGroups,
  fnv1a,
  groupOf,
  numericKeys,
  PALETTE_DARK,
  PALETTE_LIGHT,
  RAW_ALPHA,
  runColour,
  runLineColours,
  runStyles,
  smoothed,
  unitOf,
  withAlpha
} from '../src/metrics';

/** WCAG contrast of two #rrggbb colours. */
function contrast(a: string, b: string): number {
  const lum = (h: string) => {
    const [r, g, bl] = [1, 3, 5].map(
      i => parseInt(h.slice(i, i + 2), 16) / 255
    );
    const f = (c: number) =>
      c <= 0.03928 ? c / 12.92 : Math.pow((c + 0.055) / 1.055, 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(bl);
  };
  const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
  return (x + 0.05) / (y + 0.05);
}

// metric names as the recipes log them (nbtrain/losses/dpo.py METRICS, grpo rollout.finish)
const DPO = [
  'loss',
  'grad_norm',
  'learning_rate',
  'tokens_per_s',
  'step_time',
  'epoch',
  'rewards/chosen',
  'rewards/rejected',
  'rewards/accuracies',
  'rewards/margins',
  'logps/chosen',
  'logps/rejected',
  'eval_loss',
  'eval_rewards/margins'
];
const GRPO = [
  'loss',
  'reward',
  'reward_std',
  'frac_reward_zero_std',
  'completions/mean_length',
  'completions/clipped_ratio',
  'rewards/length/mean',
  'rewards/length/std',
  'rewards/exact/mean',
  'rewards/exact/std',
  'kl',
  'clip_ratio/low_mean',
  'learning_rate',
  'tokens_per_s'
];

describe('chart groups', () => {
  it('groups keys by prefix as TensorBoard does', () => {
    expect(groupOf('rewards/margins')).toBe('rewards');
    expect(groupOf('eval_rewards/margins')).toBe('eval');
    expect(groupOf('eval_loss')).toBe('eval');
    expect(groupOf('peak_memory_gb_rank1')).toBe('memory');
    expect(groupOf('step_time')).toBe('timings');
    expect(groupOf('sample_seconds')).toBe('timings');
    expect(groupOf('tokens_per_s')).toBe('tokens_per_s');
    expect(groupOf('reward_std')).toBe('reward');
  });

  it('charts every numeric key but step and time', () => {
    const keys = numericKeys([
      { step: 1, loss: 2, time: 5, note: 'x' as unknown as number },
      { step: 2, loss: 1, 'rewards/margins': 0.3, kl: null }
    ]);
    expect(keys).toEqual(['loss', 'rewards/margins']);
  });

  it("puts a DPO run's loss, reward margin and accuracy first, and charts every metric", () => {
    const groups = chartGroups(DPO, 'dpo', true);
    expect(groups[0].name).toBe('overview');
    expect(groups[0].charts.map(c => c.key)).toEqual([
      'loss',
      'rewards/margins',
      'rewards/accuracies'
    ]);
    // eval loss is drawn over loss in a run panel
    expect(groups[0].charts[0].keys).toEqual(['loss', 'eval_loss']);
    const charted = groups.flatMap(g => g.charts.flatMap(c => c.keys));
    expect([...charted].sort()).toEqual([...DPO].sort());
    // no unit claimed for a DPO loss
    expect(groups[0].charts[0].yTitle).toBe('loss');
    expect(groups.map(g => g.name)).toEqual([
      'overview',
      'eval',
      'rewards',
      'logps',
      'grad_norm',
      'learning_rate',
      'tokens_per_s',
      'timings',
      'epoch'
    ]);
  });

  it("puts a GRPO run's reward per function, completion length and KL first", () => {
    const groups = chartGroups(GRPO, 'grpo', false);
    expect(groups[0].charts.map(c => c.key)).toEqual([
      'rewards/length/mean',
      'rewards/exact/mean',
      'reward',
      'completions/mean_length',
      'kl',
      'loss'
    ]);
    expect(groups[0].charts[3].yTitle).toBe('tokens');
    const charted = groups.flatMap(g => g.charts.flatMap(c => c.keys));
    expect([...charted].sort()).toEqual([...GRPO].sort());
    // within a group the means come before their std
    const rewards = groups.find(g => g.name === 'rewards')!;
    expect(rewards.charts.map(c => c.key)).toEqual([
      'rewards/exact/std',
      'rewards/length/std'
    ]);
  });

  it('gives SFT its loss in nats/token, and a unit only where one is true', () => {
    expect(unitOf('loss', 'sft')).toBe('nats/token');
    expect(unitOf('eval_loss', undefined)).toBe('nats/token');
    expect(unitOf('loss', 'grpo')).toBe('loss');
    expect(unitOf('grad_norm', 'sft')).toBe('grad_norm');
    expect(unitOf('mfu')).toBe('%');
    expect(unitOf('logps/chosen')).toBe('nats');
    const memory = chartGroups(
      [
        'loss',
        'peak_memory_gb',
        'peak_memory_gb_rank1',
        'peak_memory_gb_rank0'
      ],
      'sft',
      true
    ).find(g => g.name === 'memory')!;
    expect(memory.charts[0].keys).toEqual([
      'peak_memory_gb_rank0',
      'peak_memory_gb_rank1'
    ]);
  });
});

describe('smoothing that never lies', () => {
  const dense: Array<[number, number]> = [
    [1, 1],
    [2, 3],
    [3, 1],
    [4, 3]
  ];
  const spec = (key: string) =>
    chartGroups([key], 'sft', false)[0].charts.find(c => c.key === key)!;

  it('smooths a dense series and keeps its raw points', () => {
    const [line] = smoothed(
      spec('loss'),
      [{ label: 'a', colour: 0, points: dense, rows: 4 }],
      0.6
    );
    expect(line.raw).toBe(dense);
    expect(line.points[1][1]).not.toBe(3);
    expect(line.points.map(p => p[0])).toEqual([1, 2, 3, 4]);
  });

  it('never smooths the learning rate, nor a sparse (eval) series', () => {
    const [lr] = smoothed(
      spec('learning_rate'),
      [{ label: 'a', colour: 0, points: dense, rows: 4 }],
      0.9
    );
    expect(lr.raw).toBeUndefined();
    expect(lr.points).toBe(dense);
    // 4 eval points over 100 logged rows
    const [evalLine] = smoothed(
      spec('eval_loss'),
      [{ label: 'a', colour: 0, points: dense, rows: 100 }],
      0.9
    );
    expect(evalLine.raw).toBeUndefined();
  });
});

// a run id whose colour is palette index 7 (its next line wraps to 0), pinned for the notebook's test
const SHARED_RUN = { id: 'c0ffee123456', lines: ['#666666', '#1f6fb4'] };

describe('colours', () => {
  it('hashes a run id with FNV-1a, as the notebook does', () => {
    // the published FNV-1a 32-bit test vectors
    expect(fnv1a('')).toBe(0x811c9dc5);
    expect(fnv1a('a')).toBe(0xe40c292c);
    expect(fnv1a('foobar')).toBe(0xbf9cf968);
    expect(runColour('3f2a9c')).toBe(fnv1a('3f2a9c') % 8);
  });

  it('keeps a run its colour whatever runs it is compared with', () => {
    const a = runStyles([{ id: 'aa' }, { id: 'bb' }]);
    const b = runStyles([{ id: 'cc' }, { id: 'bb' }, { id: 'dd' }]);
    expect(a[1].colour).toBe(b[1].colour);
    // two runs with one colour: the later is dashed
    const same = runStyles([{ id: 'aa' }, { id: 'aa' }]);
    expect(same.map(s => s.dashed)).toEqual([false, true]);
  });

  it('reads on the background: >= 4.5:1 on dark (#111111 and #212121) and on white', () => {
    for (const c of PALETTE_DARK) {
      expect(contrast(c, '#111111')).toBeGreaterThanOrEqual(4.5);
      expect(contrast(c, '#212121')).toBeGreaterThanOrEqual(4.5);
    }
    for (const c of PALETTE_LIGHT) {
      expect(contrast(c, '#ffffff')).toBeGreaterThanOrEqual(4.5);
    }
  });

  it("draws the pinned run's lines in the colours the notebook's live plot uses", () => {
    // tests/test_live.py reads SHARED_RUN and checks that the notebook draws this run's loss and
    // eval loss in these colours: the Lab and the notebook give a run one colour
    expect(runLineColours(SHARED_RUN.id, 2).map(i => PALETTE_LIGHT[i])).toEqual(
      SHARED_RUN.lines
    );
  });

  it("draws a run panel's first line in the run's own colour (its sidebar dot), then the next ones", () => {
    // ids that hash to every palette index, so the first line is not palette index 0 by chance
    const ids = Array.from({ length: 64 }, (_, i) =>
      (i * 2654435761).toString(16)
    );
    expect(new Set(ids.map(runColour)).size).toBe(8);
    for (const id of ids) {
      // the sidebar's dot is colourVar(runColour(run.id)); compare uses runColour(run.id) too
      const dot = runColour(id);
      const lines = runLineColours(id, 3);
      expect(lines[0]).toBe(dot);
      expect(lines).toEqual([dot, (dot + 1) % 8, (dot + 2) % 8]);
      // up to 8 lines in a chart: never one colour twice
      expect(new Set(runLineColours(id, 8)).size).toBe(8);
    }
    expect(runLineColours('3f2a9c', 1)).toEqual([runColour('3f2a9c')]);
    expect(runLineColours('3f2a9c', 0)).toEqual([]);
  });

  it('draws raw lines that read on the dark background and stay apart from the smoothed line', () => {
    const blend = (hex: string, alpha: number, bg: string) => {
      const ch = (h: string, i: number) => parseInt(h.slice(i, i + 2), 16);
      return (
        '#' +
        [1, 3, 5]
          .map(i => Math.round(alpha * ch(hex, i) + (1 - alpha) * ch(bg, i)))
          .map(v => v.toString(16).padStart(2, '0'))
          .join('')
      );
    };
    expect(withAlpha('#5aa9f2', RAW_ALPHA.dark)).toBe('#5aa9f299');
    expect(withAlpha('#1f6fb4', RAW_ALPHA.light)).toBe('#1f6fb459');
    for (const c of PALETTE_DARK) {
      const raw = blend(c, RAW_ALPHA.dark, '#111111');
      // the raw line is seen (>= 3:1, WCAG's bar for graphics)
      expect(contrast(raw, '#111111')).toBeGreaterThanOrEqual(3);
      // and the smoothed line over it is told apart from it
      expect(contrast(c, raw)).toBeGreaterThanOrEqual(2);
    }
    // at the old 0.45 every raw line but the yellow was under 3:1 (2.4:1 the least)
    const old = PALETTE_DARK.map(c =>
      contrast(blend(c, 0.45, '#111111'), '#111111')
    );
    expect(Math.min(...old)).toBeLessThan(3);
    for (const c of PALETTE_LIGHT) {
      expect(
        contrast(c, blend(c, RAW_ALPHA.light, '#ffffff'))
      ).toBeGreaterThanOrEqual(2);
    }
  });
});
