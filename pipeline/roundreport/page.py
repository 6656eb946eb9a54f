"""The report as one HTML file: a Jinja2 template (autoescaped: sample IDs, labels and answers are user data), every
picture inline as a data URI, plain CSS, no script, so it opens offline, from a mail or a ticket."""

from __future__ import annotations

from typing import Any

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>tamis round {{ r.round }} report</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1500px;padding:16px 24px;
color:#1d1d1d;background:#fff}
h1{font-size:22px;margin:4px 0}h2{font-size:18px;margin:28px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 4px}.muted{color:#666}nav a{margin-right:14px}
.sheet{display:flex;flex-wrap:wrap;gap:10px}
.card{margin:0;width:150px;border:1px solid #ddd;border-radius:4px;padding:6px;font-size:12px;background:#fafafa}
.card img{display:block;margin:0 auto 4px;image-rendering:pixelated}
.card .why{color:#555}.bad{color:#b00020}.card .name{overflow-wrap:anywhere}
table{border-collapse:collapse;font-size:13px}td,th{border-bottom:1px solid #eee;padding:2px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}.bar{display:inline-block;height:10px;background:#4e79a7}
.row{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
</style></head><body>
<h1>Labeling round {{ r.round }}</h1>
<p>{{ r.labeled }} labeled samples · pool {{ r.pool }} eligible · {{ r.selected }} selected · strategy
<b>{{ r.strategy }}</b>{% if r.phase %} · phase <b>{{ r.phase }}</b>: {{ r.phase_reason }}{% endif %}
{% if r.metrics %}<br>test: {{ r.metrics }}{% endif %}{% if r.stopped %}<br><b>stopped:</b> {{ r.stopped }}{% endif %}</p>
{% if r.at_chance %}<p class="bad" id="at-chance"><b>{{ r.at_chance }}</b></p>{% endif %}
<nav><a href="#batch">the batch</a><a href="#map">pool map</a><a href="#errors">what the model gets wrong</a>
<a href="#quality">quality flags</a><a href="#curve">learning curve &amp; labels</a></nav>

<section id="batch"><h2>The batch: {{ batch|length }} samples for annotation</h2>
{% if candidates %}<p class="muted">{{ candidates }}</p>{% endif %}
{% if batch %}<div class="sheet">{% for b in batch %}<figure class="card" data-sample="{{ b.sample_id }}">
{% if b.thumb %}<img class="thumb" src="{{ b.thumb.uri }}" width="{{ b.thumb.w }}" height="{{ b.thumb.h }}"
alt="{{ b.name }}">{% endif %}<figcaption><b class="name" title="sample {{ b.sample_id }}">{{ b.name }}</b><br>
<b>#{{ b.rank + 1 }}</b> <span class="muted" title="sample {{ b.sample_id }}">{{ b.sample_id[:10] }}</span><br>
{% if b.top %}{% for a, p in b.top %}{{ a }} <b>{{ '%.2f'|format(p) }}</b>{% if not loop.last %} · {% endif %}{% endfor %}
{% elif b.answer is not none %}“{{ b.answer }}”{% if b.confidence is not none %} {{ '%.2f'|format(b.confidence) }}{% endif %}
{% else %}<span class="muted">no model answer yet</span>{% endif %}<br>
{% if b.entropy is not none %}entropy {{ '%.3f'|format(b.entropy) }}{% elif b.score is not none %}score
{{ '%.3f'|format(b.score) }}{% endif %}<br><span class="why">{{ b.reason }}</span></figcaption></figure>{% endfor %}</div>
{% else %}<p class="muted">No batch this round{% if r.stopped %} (stopped){% endif %}.</p>{% endif %}</section>

<section id="map"><h2>The pool map</h2>
{% if pool_map %}<img src="{{ pool_map }}" alt="pool map"><p class="muted">{{ map_note }}</p>
{% else %}<p class="muted">No selection embeddings or scores to draw this round.</p>{% endif %}</section>

<section id="errors"><h2>What the model gets wrong</h2>
{% if pc %}<p>accuracy <b>{{ '%.3f'|format(pc.accuracy) }}</b> (95 % CI {{ '%.3f'|format(pc.accuracy_ci95[0]) }}–{{
'%.3f'|format(pc.accuracy_ci95[1]) }}), macro F1 <b>{{ '%.3f'|format(pc.macro_f1) }}</b> (95 % CI {{
'%.3f'|format(pc.macro_f1_ci95[0]) }}–{{ '%.3f'|format(pc.macro_f1_ci95[1]) }}) on {{ pc.n }} test samples
({{ pc.bootstrap }} bootstrap resamples).</p>
<div class="row"><img src="{{ confusion }}" alt="confusion matrix">
<table><tr><th>answer</th><th>precision</th><th>recall</th><th>F1</th><th>support</th></tr>
{% for c in pc.per_class %}<tr><td>{{ c.answer }}</td><td>{{ '%.3f'|format(c.precision) }}</td><td>{{
'%.3f'|format(c.recall) }}</td><td>{{ '%.3f'|format(c.f1) }}</td><td>{{ c.support }}</td></tr>{% endfor %}</table></div>
{% elif box_pc %}<table><tr><th>class</th><th>AP@0.5</th><th>95 % CI</th><th>AP@[.5:.95]</th><th>labeled boxes</th>
</tr>{% for c in box_pc %}<tr><td>{{ c.label }}</td><td>{{ '—' if c.ap50 is none else '%.3f'|format(c.ap50) }}</td>
<td>{{ '%.3f–%.3f'|format(c.ap50_ci95[0], c.ap50_ci95[1]) if c.ap50_ci95 else '—' }}</td><td>{{ '—' if c.ap is none
else '%.3f'|format(c.ap) }}</td><td>{{ c.support }}</td></tr>{% endfor %}</table>
<p class="muted">Boxes: the test images below have the most box errors (labeled boxes green, the model's orange):
missed (no predicted box overlaps it), wrong class (IoU ≥ 0.5, another class), misplaced (IoU 0.1–0.5), extra
(a predicted box over nothing labeled).</p>
{% elif evaluated %}<p class="muted">Open answers: no confusion matrix; the errors below are exact-match misses.</p>
{% else %}<p class="muted">Not evaluated this round (no labels yet, no adapter).</p>{% endif %}
{% if wrong %}<h3>{{ 'Test images with the most box errors' if boxes else 'Test images most confidently wrong' }}</h3><div class="sheet">{% for w in wrong %}
<figure class="card">{% if w.thumb %}<img src="{{ w.thumb.uri }}" width="{{ w.thumb.w }}" height="{{ w.thumb.h }}"
alt="{{ w.name }}">{% endif %}<figcaption><b class="name" title="sample {{ w.sample_id }}">{{ w.name }}</b><br>
{% if w.errors %}<b class="bad">{{ w.errors }}</b>{% if w.confidence is not none %}<br>answer confidence {{
'%.2f'|format(w.confidence) }}{% endif %}{% else %}true <b>{{ w.answer }}</b><br>model <b class="bad">{{ w.prediction
}}</b>
{% if w.confidence is not none %}{{ '%.2f'|format(w.confidence) }}{% endif %}{% endif %}</figcaption></figure>{% endfor %}</div>{% endif %}
<h3>Likely label errors</h3><p class="muted">{{ check_message }}</p>
{% if issues %}<div class="sheet">{% for i in issues %}<figure class="card">{% if i.thumb %}<img src="{{ i.thumb.uri }}"
width="{{ i.thumb.w }}" height="{{ i.thumb.h }}" alt="{{ i.name }}">{% endif %}<figcaption><b class="name"
title="sample {{ i.sample_id }}">{{ i.name }}</b><br>given <b class="bad">{{
i.given_label }}</b><br>model <b>{{ i.suggested_label }}</b>{% if i.confidence is not none %}<br>{{
'%.0f'|format(100 * i.confidence) }} % likely wrong{% endif %}{% if i.annotators %}<br><span class="muted">by {{
i.annotators|join(', ') }}</span>{% endif %}</figcaption></figure>{% endfor %}</div>{% endif %}</section>

<section id="quality"><h2>Quality flags</h2>
{% if flags %}<p class="muted">{{ checked }} prepared samples checked; flagged samples stay in the data, those in
quality.exclude stay out of the pool.</p><div class="sheet">{% for f in flags %}<figure class="card">
{% if f.thumb %}<img src="{{ f.thumb.uri }}" width="{{ f.thumb.w }}" height="{{ f.thumb.h }}" alt="{{ f.flag }}">{% endif %}
<figcaption><b>{{ f.flag }}</b><br>{{ f.count }} ({{ '%.2f'|format(100 * f.share) }} %)<br>{% if f.name %}e.g. <span
class="name" title="sample {{ f.example }}">{{ f.name }}</span><br>{% endif %}<span class="why">{{ f.reason
}}</span></figcaption></figure>{% endfor %}</div>{% else %}<p class="muted">No quality stage output.</p>{% endif %}</section>

<section id="curve"><h2>Learning curve and labels</h2><div class="row">
{% if curve %}<img src="{{ curve }}" alt="learning curve">{% else %}<p class="muted">No evaluated round yet.</p>{% endif %}
<div>{% if balance %}<h3>Class balance of the {{ r.labeled }} labels</h3><table>{% for a, n in balance %}<tr><td>{{ a }}</td>
<td>{{ n }}</td><td style="text-align:left"><span class="bar" style="width:{{ (240 * n / balance_max)|round|int }}px">
</span></td></tr>{% endfor %}</table>{% endif %}
{% if time %}<h3>Annotator time</h3><p>{{ time }}</p>{% endif %}
{% if annotators %}<h3>Annotators (consensus: {{ annotators.method }})</h3><table><tr><th>annotator</th><th>votes</th>
<th>agreement</th><th>est. accuracy</th></tr>{% for a in annotators.annotators %}<tr><td>{{ a.annotator }}</td><td>{{ a.votes
}}</td><td>{{ pct(a.agreement) }}</td><td>{{ pct(a.accuracy) }}</td></tr>{% endfor %}</table>{% endif %}</div></div></section>
<p class="muted">Built by tamis {{ version }} from {{ r.round_dir }} in {{ '%.2f'|format(seconds) }} s. Rebuild: <code>tamis
report --round {{ r.round }}</code>.</p>
</body></html>
"""


def render_page(view: dict[str, Any]) -> str:
    """The page for `view` (the report's builder assembles it); autoescaped, so no sample text becomes markup."""
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.globals["pct"] = lambda x: "–" if x is None else f"{x:.1%}"
    return env.from_string(TEMPLATE).render(**view)
