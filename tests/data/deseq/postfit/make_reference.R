# R DESeq2 references for gpuc.get.deseq_results / deseq_summary (contrasts after the fit), control genes and
# normalisation factors (tests/deseq/test_deseq_contrasts.py). Debian r-base-core 4.2 + r-bioc-deseq2 1.38.3:
#   Rscript tests/data/deseq/postfit/make_reference.R src/gpuc/datasets/data tests/data/deseq/postfit
# Outputs (gzip csv, signif 10):
#   sim_counts / sim_coldata: simulated NB counts, 300 genes x 18 samples, group A/B/C x cond ctrl/trt, 3 each;
#     gene g1 has no count, g2-g4 none in groups B and C, g5 one huge count (a Cook's outlier)
#   ia_fit: the fit of ~ group + cond + group:cond (log2 coefficients, their covariance as R's getContrast forms it,
#     baseMean, allZero, dispersion, dispFit, maxCooks, replace), ia_cooks (genes x samples), ia_sf (size factors)
#   ia_res_<name>: results() of that fit for the contrasts below; ia_summary.txt: summary() of two of them
#   me_res_*, me_shrink_*: ~ cond + group, results() and lfcShrink(type="normal") of contrasts
#   nf_*: pasilla (every 10th gene) with normalizationFactors(dds) <- a seeded gene x sample matrix (nf_factors:
#     samples x genes, hex floats)
#   cg_*: pasilla (every 10th gene) with estimateSizeFactors(controlGenes = every 3rd of those genes)
#   defaults.csv: the default arguments of results(), DESeq(), lfcShrink() and summary()
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
src <- args[1]; out <- args[2]
w <- function(x, name) write.csv(signif(as.data.frame(x), 10), gzfile(file.path(out, paste0(name, ".csv.gz"))))
keep <- c("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")
wres <- function(res, name) {
  df <- as.data.frame(res)[, intersect(keep, colnames(res))]
  df$filterThreshold <- if (is.null(metadata(res)$filterThreshold)) NA else metadata(res)$filterThreshold
  w(df, name)
}

# ---- simulated three-level x two-level data
set.seed(39)
G <- 300
cd <- data.frame(group = factor(rep(c("A", "B", "C"), each = 6)), cond = factor(rep(rep(c("ctrl", "trt"), each = 3), 3)))
rownames(cd) <- paste0("s", 1:18)
X <- model.matrix(~ group + cond + group:cond, cd)
base <- exp(rnorm(G, 4, 1.8))
B <- cbind(log(base),
           ifelse(runif(G) < 0.3, rnorm(G, 0, 1), 0), ifelse(runif(G) < 0.3, rnorm(G, 0, 1), 0),
           ifelse(runif(G) < 0.3, rnorm(G, 0, 1), 0),
           ifelse(runif(G) < 0.2, rnorm(G, 0, 1), 0), ifelse(runif(G) < 0.2, rnorm(G, 0, 1), 0))
sf_true <- exp(rnorm(18, 0, 0.2))
mu <- exp(B %*% t(X)) * rep(sf_true, each = G)
disp <- 0.05 + 1 / rowMeans(mu)
cts <- matrix(rnbinom(G * 18, mu = mu, size = 1 / disp), G, 18)
dimnames(cts) <- list(paste0("g", 1:G), rownames(cd))
cts[1, ] <- 0
cts[2:4, cd$group != "A"] <- 0
cts[5, 7] <- 50L * max(cts[5, ]) + 1000L
w(t(cts), "sim_counts")
write.csv(cd, file.path(out, "sim_coldata.csv"))

# ---- interaction design: the fit and its contrasts
dds <- DESeqDataSetFromMatrix(cts, cd, ~ group + cond + group:cond)
dds <- DESeq(dds, quiet = TRUE)
rn <- resultsNames(dds)
cat("resultsNames:", rn, "\n")
coef <- coef(dds)
se <- as.matrix(mcols(dds)[, paste0("SE_", rn)])
# the covariance R's getContrast uses (fitBeta with maxit = 0): mu floored at minmu = 0.5, ridge 1e-6 (log2 scale)
p <- ncol(X); mm <- attr(dds, "modelMatrix"); lam <- rep(1e-6, p) / log(2)^2
cov <- matrix(NA_real_, nrow(dds), p * p)
for (i in which(!mcols(dds)$allZero)) {
  m <- pmax(sizeFactors(dds) * exp(mm %*% (log(2) * coef[i, ])), 0.5)
  wv <- as.vector(m / (1 + dispersions(dds)[i] * m))
  xtwx <- t(mm) %*% (mm * wv)
  ri <- solve(xtwx + diag(lam))
  sig <- ri %*% xtwx %*% ri
  cov[i, ] <- as.vector(sig / log(2)^2)
}
stopifnot(max(abs(sqrt(cov[, seq(1, p * p, by = p + 1)]) / se - 1), na.rm = TRUE) < 1e-8)
colnames(cov) <- paste0("cov", seq_len(p * p))
fit <- data.frame(coef, cov, baseMean = mcols(dds)$baseMean, allZero = as.numeric(mcols(dds)$allZero),
                  dispersion = dispersions(dds), dispFit = mcols(dds)$dispFit, maxCooks = mcols(dds)$maxCooks,
                  replace = as.numeric(if (is.null(mcols(dds)$replace)) FALSE else mcols(dds)$replace),
                  check.names = FALSE)
w(fit, "ia_fit")
w(assays(dds)[["cooks"]], "ia_cooks")
w(data.frame(sizeFactor = sizeFactors(dds), row.names = colnames(dds)), "ia_sf")
ia <- list(
  C_vs_B = results(dds, contrast = c("group", "C", "B")),
  B_vs_A = results(dds, contrast = c("group", "B", "A")),
  A_vs_C = results(dds, contrast = c("group", "A", "C")),
  numeric_ia = results(dds, contrast = c(0, 0, 0, 0, 1, -1)),
  numeric_mixed = results(dds, contrast = c(0, 1, 0, 0.5, 0, 0)),
  list_BtrtvsA = results(dds, contrast = list(c("group_B_vs_A", "groupB.condtrt"))),
  list_CtrtvsBtrt = results(dds, contrast = list("groupC.condtrt", "groupB.condtrt")),
  list_values = results(dds, contrast = list("group_C_vs_A", "group_B_vs_A"), listValues = c(0.5, -2)),
  name_cond = results(dds, name = "cond_trt_vs_ctrl"),
  thr_greaterAbs = results(dds, name = "cond_trt_vs_ctrl", lfcThreshold = 0.5, altHypothesis = "greaterAbs"),
  thr_lessAbs = results(dds, name = "cond_trt_vs_ctrl", lfcThreshold = 0.5, altHypothesis = "lessAbs"),
  thr_greater = results(dds, name = "cond_trt_vs_ctrl", lfcThreshold = 0.5, altHypothesis = "greater"),
  thr_less = results(dds, name = "cond_trt_vs_ctrl", lfcThreshold = 0.5, altHypothesis = "less"),
  C_vs_B_nofilter = results(dds, contrast = c("group", "C", "B"), cooksCutoff = FALSE, independentFiltering = FALSE),
  C_vs_B_cut2 = results(dds, contrast = c("group", "C", "B"), cooksCutoff = 2),
  C_vs_B_alpha05 = results(dds, contrast = c("group", "C", "B"), alpha = 0.05)
)
for (nm in names(ia)) wres(ia[[nm]], paste0("ia_res_", nm))
sink(file.path(out, "ia_summary.txt"))
summary(ia$C_vs_B)
summary(ia$thr_greater)
summary(ia$C_vs_B, alpha = 0.05)
sink()

# ---- main effects: results and lfcShrink(type = "normal") of contrasts
dme <- DESeqDataSetFromMatrix(cts, cd, ~ cond + group)
dme <- DESeq(dme, quiet = TRUE)
cat("resultsNames (main effects):", resultsNames(dme), "\n")
wres(results(dme, contrast = c("group", "C", "B")), "me_res_C_vs_B")
cat("expanded columns:", colnames(DESeq2:::makeExpandedModelMatrix(dme)), "\n")
s <- suppressMessages(lfcShrink(dme, contrast = c("group", "C", "B"), type = "normal"))
w(as.data.frame(s)[, c("log2FoldChange", "lfcSE")], "me_shrink_C_vs_B")
# a numeric contrast of lfcShrink(type = "normal") is over the expanded columns (Intercept, condctrl, condtrt,
# groupA, groupB, groupC): this one is cond_trt_vs_ctrl + 0.5 group_B_vs_A - group_C_vs_A of the standard columns
s <- suppressMessages(lfcShrink(dme, contrast = c(0, -1, 1, 0.5, 0.5, -1), type = "normal",
                                res = results(dme, contrast = c(0, 1, 0.5, -1))))
w(as.data.frame(s)[, c("log2FoldChange", "lfcSE")], "me_shrink_numeric")
# one coefficient (coef=): the standard model matrix, a prior variance per coefficient
s <- suppressMessages(lfcShrink(dme, coef = "group_B_vs_A", type = "normal"))
w(as.data.frame(s)[, c("log2FoldChange", "lfcSE")], "me_shrink_coef_B")

# ---- pasilla: normalisation factors and control genes
pc <- as.matrix(read.csv(gzfile(file.path(src, "pasilla_counts.csv.gz")), row.names = 1))
pc <- pc[seq(1, nrow(pc), by = 10), ]
md <- read.csv(file.path(src, "pasilla_metadata.csv"), row.names = 1, check.names = FALSE)
md <- md[colnames(pc), c("condition", "type")]
md$condition <- factor(md$condition, levels = c("untreated", "treated")); md$type <- factor(md$type)
set.seed(305)
nf <- matrix(exp(rnorm(length(pc), 0, 0.25)), nrow(pc)) * rep(exp(rnorm(ncol(pc), 0, 0.3)), each = nrow(pc))
dimnames(nf) <- dimnames(pc)
# the factors as C99 hex floats (every bit), so that gpuc's fit starts from R's exact input
hx <- t(nf); hx[] <- sprintf("%a", hx)
write.csv(hx, gzfile(file.path(out, "nf_factors.csv.gz")), quote = FALSE)
dn <- DESeqDataSetFromMatrix(pc, md, ~ type + condition)
normalizationFactors(dn) <- nf
dn <- DESeq(dn, quiet = TRUE)
wres(results(dn, contrast = c("condition", "treated", "untreated")), "nf_res")
w(data.frame(baseMean = mcols(dn)$baseMean, dispGeneEst = mcols(dn)$dispGeneEst, dispFit = mcols(dn)$dispFit,
             dispersion = dispersions(dn), maxCooks = mcols(dn)$maxCooks, row.names = rownames(dn)), "nf_genes")
dc <- DESeqDataSetFromMatrix(pc, md, ~ type + condition)
ctrl <- seq(1, nrow(pc), by = 3)
dc <- estimateSizeFactors(dc, controlGenes = ctrl)
dc <- DESeq(dc, quiet = TRUE)
w(data.frame(sizeFactor = sizeFactors(dc), row.names = colnames(dc)), "cg_sf")
wres(results(dc, contrast = c("condition", "treated", "untreated")), "cg_res")

# ---- defaults
fmt <- function(f, fun) {
  v <- formals(f)
  data.frame(fun = fun, arg = names(v),
             default = vapply(v, function(x) paste(deparse(x), collapse = ""), ""), row.names = NULL)
}
defs <- rbind(fmt(DESeq2::results, "results"), fmt(DESeq2::DESeq, "DESeq"), fmt(DESeq2::lfcShrink, "lfcShrink"),
              fmt(DESeq2:::summary.DESeqResults, "summary"))
write.csv(defs, file.path(out, "defaults.csv"), row.names = FALSE)
cat("DESeq2", as.character(packageVersion("DESeq2")), "\n")
