# R DESeq2 references for the branches R takes (gpuc issue 42): simulated negative-binomial counts, DESeq() with its
# defaults unless said, results() with alpha = 0.1 for the last design column (R's default).
# Run from this folder: Rscript make_reference.R   (R 4.2.2, DESeq2 1.38.3, Debian r-bioc-deseq2)
# Each set gets its own folder: counts.csv.gz (genes x samples), metadata.csv, spec.json (design, contrast, options
# for gpuc.tl.deseq), gene_fit.csv.gz (R's per-gene values, 17 digits) and globals.csv (trend, prior variance).
suppressMessages(library(DESeq2))

sim <- function(n_genes, cols, mean_log2 = c(5, 2), disp = function(m) 0.05 + 2 / m, lfc = NULL, seed = 1) {
  set.seed(seed)
  n <- nrow(cols)
  base <- 2^rnorm(n_genes, mean_log2[1], mean_log2[2])
  sf <- exp(rnorm(n, 0, 0.2))
  eta <- matrix(log(base), n_genes, n)
  if (!is.null(lfc)) eta <- eta + lfc
  mu <- exp(eta) * rep(sf, each = n_genes)
  a <- disp(base)
  m <- matrix(rnbinom(n_genes * n, mu = mu, size = 1 / a), n_genes, n)
  dimnames(m) <- list(sprintf("g%04d", seq_len(n_genes)), rownames(cols))
  m
}

write_set <- function(name, counts, cols, design, fitType = "parametric", spec_extra = "") {
  dir.create(name, showWarnings = FALSE)
  dds <- DESeqDataSetFromMatrix(counts, cols, design)
  dds <- DESeq(dds, fitType = fitType, quiet = TRUE)
  res <- results(dds, alpha = 0.1)
  mc <- mcols(dds)
  f <- function(v) format(v, digits = 17)
  out <- data.frame(baseMean = f(mc$baseMean), dispGeneEst = f(mc$dispGeneEst), dispGeneIter = mc$dispGeneIter,
                    dispFit = f(mc$dispFit), dispMAP = f(mc$dispMAP), dispersion = f(mc$dispersion),
                    dispOutlier = mc$dispOutlier,
                    replace = if (is.null(mc$replace)) FALSE else mc$replace,
                    betaConv = mc$betaConv, betaIter = mc$betaIter,
                    log2FoldChange = f(res$log2FoldChange), lfcSE = f(res$lfcSE), stat = f(res$stat),
                    pvalue = f(res$pvalue), padj = f(res$padj), row.names = rownames(dds))
  write.csv(out, gzfile(file.path(name, "gene_fit.csv.gz")), quote = FALSE)
  write.csv(counts, gzfile(file.path(name, "counts.csv.gz")), quote = FALSE)
  write.csv(as.data.frame(cols), file.path(name, "metadata.csv"), quote = FALSE)
  fn <- dispersionFunction(dds)
  co <- attr(fn, "coefficients")
  g <- data.frame(key = c("fitType", "asymptDisp", "extraPois", "mean", "varLogDispEsts", "dispPriorVar", "resultsName", "DESeq2"),
                  value = c(attr(fn, "fitType"), if (is.null(co)) NA else f(co[1]), if (is.null(co)) NA else f(co[2]),
                            if (is.null(attr(fn, "mean"))) NA else f(attr(fn, "mean")),
                            f(attr(fn, "varLogDispEsts")), f(attr(fn, "dispPriorVar")),
                            tail(resultsNames(dds), 1), as.character(packageVersion("DESeq2"))))
  write.csv(g, file.path(name, "globals.csv"), row.names = FALSE)
  lv <- sapply(names(cols), function(k) if (is.factor(cols[[k]])) sprintf('"%s": ["%s"]', k, paste(levels(cols[[k]]), collapse = '", "')) else NA)
  lv <- lv[!is.na(lv)]
  spec <- sprintf('{"design": "%s", "contrast": null, "categorical": [%s], "levels": {%s}, "kwargs": {"fit_type": "%s"%s}}\n',
                  paste(deparse(design), collapse = ""),
                  paste(sprintf('"%s"', names(lv)), collapse = ", "), paste(lv, collapse = ", "), fitType, spec_extra)
  writeLines(spec, file.path(name, "spec.json"))
  cat(name, attr(fn, "fitType"), "prior var", attr(fn, "dispPriorVar"), "replaced", sum(out$replace), "padj<0.1", sum(res$padj < 0.1, na.rm = TRUE), "\n")
}

G <- 800
# 2 vs 2: n - p = 2, so R matches the prior variance by simulation (set.seed(2) inside DESeq2)
cols <- data.frame(condition = factor(rep(c("A", "B"), each = 2)), row.names = sprintf("s%d", 1:4))
lfc <- outer(ifelse(runif(G) < 0.1, rnorm(G, 0, 1.5), 0), c(0, 0, 1, 1))
write_set("two_vs_two", sim(G, cols, lfc = lfc, seed = 11), cols, ~condition)

# local trend fallback: Poisson counts (no overdispersion), the parametric fit fails
cols <- data.frame(condition = factor(rep(c("A", "B"), each = 4)), row.names = sprintf("s%d", 1:8))
set.seed(12); lfc <- outer(ifelse(runif(G) < 0.1, rnorm(G, 0, 1), 0), rep(c(0, 1), each = 4))
write_set("local_fallback", sim(G, cols, disp = function(m) rep(1e-9, length(m)), lfc = lfc, seed = 12), cols, ~condition)

# fitType = "mean"
cols <- data.frame(condition = factor(rep(c("A", "B"), each = 3)), row.names = sprintf("s%d", 1:6))
set.seed(13); lfc <- outer(ifelse(runif(G) < 0.1, rnorm(G, 0, 1.5), 0), rep(c(0, 1), each = 3))
write_set("mean_trend", sim(G, cols, lfc = lfc, seed = 13), cols, ~condition, fitType = "mean", spec_extra = "")

# outlier replacement: 7 vs 7 (replaceable), 20 counts multiplied by 50
cols <- data.frame(condition = factor(rep(c("A", "B"), each = 7)), row.names = sprintf("s%02d", 1:14))
set.seed(14); lfc <- outer(ifelse(runif(G) < 0.1, rnorm(G, 0, 1), 0), rep(c(0, 1), each = 7))
m <- sim(G, cols, lfc = lfc, seed = 14)
set.seed(15); idx <- cbind(sample(G, 20), sample(14, 20, replace = TRUE)); m[idx] <- m[idx] * 50L + 100L
write_set("outliers_7", m, cols, ~condition)

# continuous covariate with a batch factor
set.seed(16)
cols <- data.frame(batch = factor(rep(c("b1", "b2", "b3"), 4)), x = round(rnorm(12), 3), row.names = sprintf("s%02d", 1:12))
lfc <- outer(ifelse(runif(G) < 0.15, rnorm(G, 0, 0.7), 0), cols$x)
write_set("continuous_cov", sim(G, cols, lfc = lfc, seed = 16), cols, ~batch + x)

# interaction: genotype x treatment, 3 per cell
cols <- data.frame(genotype = factor(rep(c("wt", "mut"), each = 6), levels = c("wt", "mut")),
                   treatment = factor(rep(rep(c("ctrl", "trt"), each = 3), 2)), row.names = sprintf("s%02d", 1:12))
set.seed(17)
lfc <- outer(ifelse(runif(G) < 0.1, rnorm(G, 0, 1), 0), as.numeric(cols$treatment == "trt")) +
  outer(ifelse(runif(G) < 0.1, rnorm(G, 0, 1.5), 0), as.numeric(cols$treatment == "trt" & cols$genotype == "mut"))
write_set("interaction", sim(G, cols, lfc = lfc, seed = 17), cols, ~genotype + treatment + genotype:treatment)
