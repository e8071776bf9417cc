/*
 * nnlib_harness: build ONE hexagon_nn graph from a line-based text spec, prepare it,
 * execute it once (or --iters times) and write the outputs as raw .bin files.
 *
 * Part of maceq tools/nnlib (own code; links against XiaoMi/nnlib built for Hexagon Linux).
 *
 * Usage:  nnlib_harness [-v LEVEL] [--prepare-only] [--iters N] SPEC OUTDIR
 *
 * Spec (one item per line; '#' starts a comment; paths relative to the spec's directory):
 *   const  ID B H W D FILE          const node; FILE holds the raw bytes ('-' = no data, dataLen 0)
 *   input  ID                       the INPUT node; its outputs are the 'feed' lines, in order
 *   feed   ES B H W D FILE          one execute input: element size ES bytes, shape, raw bytes
 *                                   (without an 'input' line the feeds are passed to execute as
 *                                   they are, for a graph whose QuantizeINPUT_f_to_8 node reads
 *                                   them itself, as MACE's DSP runtime builds it)
 *   node   ID OPNAME PAD NIN SRC:PORT... NOUT ES:B:H:W:D...
 *                                   an op node; PAD = NA|SAME|VALID|MIRROR_REFLECT|
 *                                   MIRROR_SYMMETRIC|SAME_CAFFE or a number; output max shapes
 *   output SRC:PORT MAXBYTES        one graph output (all collected into one OUTPUT node)
 *   outbuf MAXBYTES [FILE]          one execute output buffer NOT wired to the OUTPUT node, for a
 *                                   graph whose DequantizeOUTPUT_8tof node writes the outputs
 *                                   itself (MACE: 4 per output: data, min, max, flag); FILE =
 *                                   initial contents. 'output'/'outbuf' order = output order.
 *   option NAME VALUE               hexagon_nn_set_graph_option(NAME, VALUE)
 *
 * OUTDIR/result.txt gets lines:
 *   prepare ok|fail RC
 *   node ID OPNAME NIN NOUT         every node of the graph after prepare (nnlib's rewrites,
 *                                   e.g. Supernode_8x8p32to8 -> Supernode_8x8p32to8_d32)
 *   execute ok|fail RC
 *   output I B H W D LEN            OUTDIR/outI.bin holds LEN bytes
 *   time_prepare_s T / time_execute_s T (per iteration)
 * OUTDIR/log.txt gets nnlib's log buffer.
 * Exit status: 0 ok, 2 prepare failed, 3 execute failed, 1 usage/spec/IO error.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <hexagon_nn.h>

#define MAXTOK 256
#define MAXNODES 4096

struct const_spec { uint32_t id, b, h, w, d; uint8_t *data; uint32_t len; };
struct feed_spec  { uint32_t es, b, h, w, d; uint8_t *data; uint32_t len; };
struct node_spec  {
	uint32_t id; unsigned op; int pad; char name[96];
	uint32_t nin, nout; struct input *in; struct output *out;
};
struct out_spec   { struct input ref; uint32_t maxbytes; int is_buf; uint8_t *init; uint32_t initlen; };
struct opt_spec   { char name[64]; int value; };

static struct const_spec consts[MAXNODES]; static int nconsts;
static struct feed_spec feeds[64]; static int nfeeds;
static struct node_spec nodes[MAXNODES]; static int nnodes;
static struct out_spec outs[MAXNODES]; static int nouts;
static struct opt_spec opts[32]; static int nopts;
static uint32_t input_id; static int have_input;
static uint32_t max_id;

static void die(const char *fmt, const char *a, int line)
{
	fprintf(stderr, "nnlib_harness: ");
	fprintf(stderr, fmt, a);
	if (line > 0) fprintf(stderr, " (spec line %d)", line);
	fprintf(stderr, "\n");
	exit(1);
}

static void *xalloc(size_t n)
{
	void *p = NULL;
	if (posix_memalign(&p, 128, n ? n : 128) != 0) die("out of memory%s", "", 0);
	memset(p, 0, n ? n : 128);
	return p;
}

static char specdir[1024];

static uint8_t *read_file(const char *name, uint32_t *len, int line)
{
	char path[2048];
	if (name[0] == '/') snprintf(path, sizeof path, "%s", name);
	else snprintf(path, sizeof path, "%s/%s", specdir, name);
	FILE *f = fopen(path, "rb");
	if (!f) die("cannot open %s", path, line);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	uint8_t *p = xalloc((size_t)n);
	if (n > 0 && fread(p, 1, (size_t)n, f) != (size_t)n) die("cannot read %s", path, line);
	fclose(f);
	*len = (uint32_t)n;
	return p;
}

static uint32_t num(const char *s, int line)
{
	char *e;
	errno = 0;
	unsigned long v = strtoul(s, &e, 0);
	if (errno || *e) die("bad number '%s'", s, line);
	return (uint32_t)v;
}

static void note_id(uint32_t id, int line)
{
	if (id == 0) die("node id 0 is reserved%s", "", line);
	if (id > max_id) max_id = id;
}

static struct input ref(const char *s, int line)
{
	char buf[64];
	snprintf(buf, sizeof buf, "%s", s);
	char *c = strchr(buf, ':');
	struct input r;
	if (!c) die("bad ref '%s' (want SRC:PORT)", s, line);
	*c = 0;
	r.src_id = num(buf, line);
	r.output_idx = num(c + 1, line);
	return r;
}

static int padding(const char *s, int line)
{
	static const char *names[] = {"NA", "SAME", "VALID", "MIRROR_REFLECT", "MIRROR_SYMMETRIC", "SAME_CAFFE"};
	for (int i = 0; i < 6; i++)
		if (!strcmp(s, names[i])) return i;
	return (int)num(s, line);
}

static struct output outdef(const char *s, int line)
{
	struct output o;
	unsigned es, b, h, w, d;
	memset(&o, 0, sizeof o);
	if (sscanf(s, "%u:%u:%u:%u:%u", &es, &b, &h, &w, &d) != 5) die("bad output def '%s' (want ES:B:H:W:D)", s, line);
	o.rank = 4;
	o.max_sizes[0] = b; o.max_sizes[1] = h; o.max_sizes[2] = w; o.max_sizes[3] = d;
	o.elementsize = es;
	return o;
}

static void parse_spec(const char *path)
{
	FILE *f = fopen(path, "r");
	if (!f) die("cannot open spec %s", path, 0);
	snprintf(specdir, sizeof specdir, "%s", path);
	char *slash = strrchr(specdir, '/');
	if (slash) *slash = 0; else snprintf(specdir, sizeof specdir, ".");

	char line[65536];
	int ln = 0;
	while (fgets(line, sizeof line, f)) {
		ln++;
		char *hash = strchr(line, '#');
		if (hash) *hash = 0;
		char *tok[MAXTOK];
		int nt = 0;
		for (char *t = strtok(line, " \t\r\n"); t && nt < MAXTOK; t = strtok(NULL, " \t\r\n")) tok[nt++] = t;
		if (nt == 0) continue;
		if (!strcmp(tok[0], "const")) {
			if (nt != 7) die("const wants 6 fields%s", "", ln);
			if (nconsts >= MAXNODES) die("too many consts%s", "", ln);
			struct const_spec *c = &consts[nconsts++];
			c->id = num(tok[1], ln); note_id(c->id, ln);
			c->b = num(tok[2], ln); c->h = num(tok[3], ln); c->w = num(tok[4], ln); c->d = num(tok[5], ln);
			if (strcmp(tok[6], "-")) c->data = read_file(tok[6], &c->len, ln);
		} else if (!strcmp(tok[0], "input")) {
			if (nt != 2) die("input wants 1 field%s", "", ln);
			input_id = num(tok[1], ln); note_id(input_id, ln);
			have_input = 1;
		} else if (!strcmp(tok[0], "feed")) {
			if (nt != 7) die("feed wants 6 fields%s", "", ln);
			if (nfeeds >= 64) die("too many feeds%s", "", ln);
			struct feed_spec *fd = &feeds[nfeeds++];
			fd->es = num(tok[1], ln); fd->b = num(tok[2], ln); fd->h = num(tok[3], ln);
			fd->w = num(tok[4], ln); fd->d = num(tok[5], ln);
			fd->data = read_file(tok[6], &fd->len, ln);
			if (fd->len != fd->es * fd->b * fd->h * fd->w * fd->d) die("feed %s: size does not match shape", tok[6], ln);
		} else if (!strcmp(tok[0], "node")) {
			if (nt < 6) die("node line too short%s", "", ln);
			if (nnodes >= MAXNODES) die("too many nodes%s", "", ln);
			struct node_spec *n = &nodes[nnodes++];
			n->id = num(tok[1], ln); note_id(n->id, ln);
			snprintf(n->name, sizeof n->name, "%s", tok[2]);
			if (hexagon_nn_op_name_to_id(tok[2], &n->op) != 0) die("unknown op '%s'", tok[2], ln);
			n->pad = padding(tok[3], ln);
			n->nin = num(tok[4], ln);
			if (5 + (int)n->nin >= nt) die("node: missing inputs/NOUT%s", "", ln);
			n->in = xalloc(sizeof(struct input) * (n->nin + 1));
			for (uint32_t i = 0; i < n->nin; i++) n->in[i] = ref(tok[5 + i], ln);
			int k = 5 + n->nin;
			n->nout = num(tok[k++], ln);
			if (k + (int)n->nout != nt) die("node: NOUT does not match the output defs%s", "", ln);
			n->out = xalloc(sizeof(struct output) * (n->nout + 1));
			for (uint32_t i = 0; i < n->nout; i++) n->out[i] = outdef(tok[k + i], ln);
		} else if (!strcmp(tok[0], "output")) {
			if (nt != 3) die("output wants 2 fields%s", "", ln);
			if (nouts >= MAXNODES) die("too many outputs%s", "", ln);
			outs[nouts].ref = ref(tok[1], ln);
			outs[nouts].maxbytes = num(tok[2], ln);
			nouts++;
		} else if (!strcmp(tok[0], "outbuf")) {
			if (nt != 2 && nt != 3) die("outbuf wants 1 or 2 fields%s", "", ln);
			if (nouts >= MAXNODES) die("too many outputs%s", "", ln);
			outs[nouts].is_buf = 1;
			outs[nouts].maxbytes = num(tok[1], ln);
			if (nt == 3) outs[nouts].init = read_file(tok[2], &outs[nouts].initlen, ln);
			if (outs[nouts].initlen > outs[nouts].maxbytes) die("outbuf %s: file larger than MAXBYTES", tok[2], ln);
			nouts++;
		} else if (!strcmp(tok[0], "option")) {
			if (nt != 3 || nopts >= 32) die("bad option line%s", "", ln);
			snprintf(opts[nopts].name, sizeof opts[nopts].name, "%s", tok[1]);
			opts[nopts].value = (int)strtol(tok[2], NULL, 0);
			nopts++;
		} else {
			die("unknown keyword '%s'", tok[0], ln);
		}
	}
	fclose(f);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char outdir[1024];
static FILE *result;

static void dump_log(hexagon_nn_nn_id id)
{
	static unsigned char buf[1 << 20];
	char path[1200];
	buf[0] = 0;
	hexagon_nn_getlog(id, buf, sizeof buf);
	snprintf(path, sizeof path, "%s/log.txt", outdir);
	FILE *f = fopen(path, "a");
	if (f) { fputs((char *)buf, f); fclose(f); }
}

static void list_nodes(hexagon_nn_nn_id id)
{
	struct nn_graph *g = nn_id_to_graph(id);
	if (!g) return;
	for (struct nn_node *n = g->head; n; n = n->next) {
		char name[128] = "?";
		hexagon_nn_op_id_to_name(n->node_type, name, sizeof name);
		if (!strcmp(name, "Const")) continue;
		fprintf(result, "node %u %s %u %u\n", (unsigned)n->node_id, name, (unsigned)n->n_inputs,
			(unsigned)n->n_outputs);
	}
}

int main(int argc, char **argv)
{
	int debug = 0, prepare_only = 0, iters = 1;
	const char *spec = NULL, *od = NULL;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "-v") && i + 1 < argc) debug = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--prepare-only")) prepare_only = 1;
		else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
		else if (!spec) spec = argv[i];
		else if (!od) od = argv[i];
		else die("unexpected argument %s", argv[i], 0);
	}
	if (!spec || !od || iters < 1) {
		fprintf(stderr, "usage: nnlib_harness [-v LEVEL] [--prepare-only] [--iters N] SPEC OUTDIR\n");
		return 1;
	}
	snprintf(outdir, sizeof outdir, "%s", od);
	parse_spec(spec);

	char rpath[1200];
	snprintf(rpath, sizeof rpath, "%s/result.txt", outdir);
	result = fopen(rpath, "w");
	if (!result) die("cannot write %s", rpath, 0);
	snprintf(rpath, sizeof rpath, "%s/log.txt", outdir);
	remove(rpath);

	hexagon_nn_config();
	hexagon_nn_nn_id id;
	if (hexagon_nn_init(&id) != 0) die("hexagon_nn_init failed%s", "", 0);
	hexagon_nn_set_debug_level(id, debug);
	for (int i = 0; i < nopts; i++)
		if (hexagon_nn_set_graph_option(id, opts[i].name, opts[i].value) != 0) die("graph option %s rejected", opts[i].name, 0);

	int rc;
	for (int i = 0; i < nconsts; i++) {
		struct const_spec *c = &consts[i];
		rc = hexagon_nn_append_const_node(id, c->id, c->b, c->h, c->w, c->d, c->data, c->len);
		if (rc) { fprintf(result, "append const %u fail %d\n", c->id, rc); dump_log(id); return 2; }
	}
	if (have_input) {
		unsigned op;
		struct output *o = xalloc(sizeof(struct output) * (nfeeds + 1));
		for (int i = 0; i < nfeeds; i++) {
			o[i].rank = 4;
			o[i].max_sizes[0] = feeds[i].b; o[i].max_sizes[1] = feeds[i].h;
			o[i].max_sizes[2] = feeds[i].w; o[i].max_sizes[3] = feeds[i].d;
			o[i].elementsize = feeds[i].es;
		}
		hexagon_nn_op_name_to_id("INPUT", &op);
		rc = hexagon_nn_append_node(id, input_id, op, NN_PAD_NA, NULL, 0, o, nfeeds);
		if (rc) { fprintf(result, "append INPUT fail %d\n", rc); dump_log(id); return 2; }
	}
	for (int i = 0; i < nnodes; i++) {
		struct node_spec *n = &nodes[i];
		rc = hexagon_nn_append_node(id, n->id, n->op, n->pad, n->in, n->nin, n->out, n->nout);
		if (rc) { fprintf(result, "append node %u %s fail %d\n", n->id, n->name, rc); dump_log(id); return 2; }
	}
	int nwired = 0;
	struct input *in = xalloc(sizeof(struct input) * (nouts + 1));
	for (int i = 0; i < nouts; i++)
		if (!outs[i].is_buf) in[nwired++] = outs[i].ref;
	if (nwired) {
		unsigned op;
		hexagon_nn_op_name_to_id("OUTPUT", &op);
		rc = hexagon_nn_append_node(id, max_id + 1, op, NN_PAD_NA, in, nwired, NULL, 0);
		if (rc) { fprintf(result, "append OUTPUT fail %d\n", rc); dump_log(id); return 2; }
	}

	double t0 = now_s();
	rc = hexagon_nn_prepare(id);
	double t1 = now_s();
	fprintf(result, "prepare %s %d\n", rc ? "fail" : "ok", rc);
	fprintf(result, "time_prepare_s %.6f\n", t1 - t0);
	dump_log(id);
	if (rc) { fclose(result); return 2; }
	list_nodes(id);
	if (prepare_only) { fclose(result); hexagon_nn_teardown(id); return 0; }

	hexagon_nn_tensordef *tin = xalloc(sizeof(hexagon_nn_tensordef) * (nfeeds + 1));
	hexagon_nn_tensordef *tout = xalloc(sizeof(hexagon_nn_tensordef) * (nouts + 1));
	for (int i = 0; i < nfeeds; i++) {
		tin[i].batches = feeds[i].b; tin[i].height = feeds[i].h;
		tin[i].width = feeds[i].w; tin[i].depth = feeds[i].d;
		tin[i].data = feeds[i].data;
		tin[i].dataLen = feeds[i].len;
		tin[i].data_valid_len = feeds[i].len;
	}
	for (int i = 0; i < nouts; i++) {
		tout[i].data = xalloc(outs[i].maxbytes);
		tout[i].dataLen = outs[i].maxbytes;
		if (outs[i].init) memcpy(tout[i].data, outs[i].init, outs[i].initlen);
	}
	double t2 = now_s();
	for (int it = 0; it < iters; it++) {
		rc = hexagon_nn_execute_new(id, tin, nfeeds, tout, nouts);
		if (rc) break;
	}
	double t3 = now_s();
	fprintf(result, "execute %s %d\n", rc ? "fail" : "ok", rc);
	fprintf(result, "time_execute_s %.6f\n", (t3 - t2) / iters);
	dump_log(id);
	if (rc) { fclose(result); return 3; }
	for (int i = 0; i < nouts; i++) {
		char path[1200];
		snprintf(path, sizeof path, "%s/out%d.bin", outdir, i);
		FILE *f = fopen(path, "wb");
		if (!f) die("cannot write %s", path, 0);
		fwrite(tout[i].data, 1, tout[i].data_valid_len, f);
		fclose(f);
		fprintf(result, "output %d %u %u %u %u %u\n", i, tout[i].batches, tout[i].height, tout[i].width,
			tout[i].depth, tout[i].data_valid_len);
	}
	fclose(result);
	hexagon_nn_teardown(id);
	return 0;
}
